"""How the agent reads tensors: which ones the engines read in place (CPU tensors on the
CPU engine, CUDA tensors on the CUDA engine, on their current stream: never through the
host), the first floating-point tensor of a module's output, a short description of a
forward's inputs, sums that stay on their device, and which modules' outputs are never
worth reading (bounded by their input)."""
import math
import typing

import torch

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def float_tensors(value) -> list:
    """Every floating-point tensor in an output (nested lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in float_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in float_tensors(v)]
    return []


def holds_nonfinite(session, tensor) -> bool:
    """NaN/Inf anywhere in a host tensor: the activations' check where it can read the tensor
    in place, torch's otherwise."""
    code = DTYPE_CODE.get(tensor.dtype)
    if code is not None and tensor.is_contiguous() and tensor.layout is torch.strided:
        return session.has_nonfinite(tensor.data_ptr(), tensor.numel(), code)
    return not bool(torch.isfinite(tensor).all())


def is_or_views(value, tensor) -> bool:
    """Whether `value` is `tensor`, unchanged or a view of it: a module given it receives
    what that tensor's maker made."""
    return value is tensor or getattr(value, "_base", None) is tensor


def first_float_tensor(value):
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (list, tuple)):
        for v in value:
            found = first_float_tensor(v)
            if found is not None:
                return found
    if isinstance(value, dict):
        for v in value.values():
            found = first_float_tensor(v)
            if found is not None:
                return found
    return None


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one gap-free block of memory, in any order (contiguous,
    or a permutation of a contiguous tensor, such as a transpose)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


ENGINE_DEVICES = {"cpu": 0, "cuda": 1}  # the session's device type codes


# The raw cudaStream_t of a device's current stream, as torch's compiler reads it: the
# public torch.cuda.current_stream() builds a Stream object, ~10 µs that every hook and
# every gradient paid (on a host-bound GPU step, that is step time).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(index: int) -> int:
    """The cudaStream_t of CUDA device `index`'s current stream (reading it does not sync)."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def fast_place(t: torch.Tensor):
    """(data_ptr, numel, dtype code, device type code, device index, stream) of a contiguous
    CPU or CUDA float tensor an engine reads in place, else None: the hooks' and the
    gradient pass's fast path (checks ordered cheapest first)."""
    code = DTYPE_CODE.get(t.dtype)
    if code is None or not t.is_contiguous() or t.layout is not torch.strided:
        return None
    if type(t) is not torch.Tensor and distributed(t):
        t = local_shard(t)
        if not t.is_contiguous():
            return None
    if t.is_cpu:
        return t.data_ptr(), t.numel(), code, 0, 0, 0
    if t.is_cuda:
        index = t.get_device()
        return t.data_ptr(), t.numel(), code, 1, index, current_stream_handle(index)
    return None


def activation_elsewhere(session, module_id, tensor, micro_batch):
    """The session's activation() of an output off the forward hook's fast path: a CUDA one
    read on its current stream, or a dense float copy of one the engine cannot read in place."""
    fast = fast_place(tensor)
    if fast is not None:
        ptr, numel, code, kind, index, stream = fast
        return session.activation(module_id, ptr, numel, code, micro_batch, kind, index, stream)
    view = readable_view(tensor)  # the tensor itself when the engine reads it in place
    return session.activation(module_id, view.data_ptr(), view.numel(), DTYPE_CODE[view.dtype], micro_batch,
                              *engine_place(view))


def host_gradients(optimizer, layer_id, known):
    """(layer ids, pointers, sizes, dtype codes) of the optimizer's gradients when every one
    is a contiguous float32 or bfloat16 host tensor, read and unscaled in place; else None
    (FP16, sparse or device gradients take the agent's general path, which says why).
    layer_id(param) names each parameter's layer; known: id(param) -> the layer it named,
    looked up first (a call a gradient fewer, every step)."""
    layers, ptrs, numels, codes = [], [], [], []
    code_of, strided = DTYPE_CODE.get, torch.strided
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            code = code_of(g.dtype)
            if code is None or code == 1 or type(g) is not torch.Tensor or not g.is_cpu or g.layout is not strided or not g.is_contiguous():
                return None
            layer = known(id(p))
            layers.append(layer_id(p) if layer is None else layer)
            ptrs.append(g.data_ptr())
            numels.append(g.numel())
            codes.append(code)
    return layers, ptrs, numels, codes


def distributed(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2's parameters and gradients, tensor parallelism's outputs): a wrapper
    with no memory of its own (data_ptr() is 0, numel() the global size)."""
    return type(t) is not torch.Tensor and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, which the engines read (each rank's run.db holds its own
    shards' statistics; the report merges the ranks); any other tensor as it is."""
    if type(t) is torch.Tensor or not distributed(t):
        return t
    with torch.no_grad():
        return t.to_local()


def directly_readable(t: torch.Tensor) -> bool:
    """Every statistic is independent of element order, so a dense block is read in place. Not
    a DTensor: its unscale is torch's, which reduces found_inf over the ranks."""
    return (t.device.type in ENGINE_DEVICES and t.layout == torch.strided and t.dtype in DTYPE_CODE and _dense(t)
            and not distributed(t))


def readable_view(t: torch.Tensor) -> torch.Tensor:
    """t itself when the engine can read it in place (data_ptr() is then the block's first
    element: all strides are positive), else a dense float copy on t's own device (made on
    its current stream, which the engine then runs on)."""
    if directly_readable(t):
        return t
    copy = local_shard(t).detach()
    if copy.dtype not in DTYPE_CODE:
        copy = copy.float()
    return copy.contiguous()


def engine_place(t: torch.Tensor):
    """(device type code, device index, stream) for the session: which engine reads t and,
    on CUDA, the stream its producer runs on (reading the current stream does not sync)."""
    if t.device.type == "cpu":
        return 0, 0, 0
    index = t.get_device()
    return ENGINE_DEVICES[t.device.type], index, current_stream_handle(index)


def describe_inputs(args) -> str:
    """'float16, int64, NoneType': what a forward took, positionally (for the pin snippet:
    only floating-point inputs may be cast to float32)."""
    parts = []
    for a in args:
        parts.append(str(a.dtype).replace("torch.", "") if isinstance(a, torch.Tensor) else type(a).__name__)
    return ", ".join(parts)


def nan_in_inputs(args, kwargs):
    """'argument 0 (float32 [32, 16]): 1 NaN of 512 values' for the first floating-point
    tensor among a forward's arguments (and in the lists, tuples and dicts among them:
    "argument 0['x']") that holds NaN; None when none does. On a device it waits for the
    count: it runs only in a step whose outputs already went NaN/Inf."""
    found = _first_found(_named_inputs(args, kwargs), 2, _nan_count)
    return found and found.text()


# Modules that take their first argument as data to compute with, never as a mask: an Inf
# there is no -inf mask's by design, as it may be in an attention module's arguments.
DATA_LAYERS = tuple(kind for kind in (torch.nn.Linear, torch.nn.Bilinear, torch.nn.modules.conv._ConvNd,
                                      torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm,
                                      getattr(torch.nn, "RMSNorm", None), torch.nn.RNNBase) if kind is not None)


def inf_in_model_input(first_argument, args, kwargs):
    """Where a data layer's first argument holds Inf and views the memory of one of the
    model's arguments (`args`, `kwargs`: it reached the layer unchanged): that argument as
    nan_in_inputs() words it, '2 -Inf of 512 values' (a log of 0 in preprocessing), else
    None. An additive mask's -inf passed to the model is not looked at: it reaches an
    attention module, not a data layer's first argument."""
    if not isinstance(first_argument, torch.Tensor) or not first_argument.is_floating_point() \
            or first_argument.layout is not torch.strided or not bool(torch.isinf(first_argument.detach()).any()):
        return None
    found = _first_found(_named_inputs(args, kwargs), 2,
                         lambda t: _inf_count(t) if shares_memory(first_argument, t) else None)
    return found and found.text()


# fp16 rounds |x| >= 65520 (halfway above its largest value, 65504) to Inf.
FP16_ROUNDS_TO_INF = 65520.0


def beyond_fp16_in_inputs(args, kwargs) -> "Found | None":
    """The first floating-point tensor among a forward's arguments (nested as for
    nan_in_inputs) holding finite values that fp16 cannot hold, which turn into Inf where
    autocast casts them to float16: its text() is 'argument 0 (float32 [128, 64]): 37 of
    8192 values at or beyond 65520, max |x| 221847'. None when none does. Runs only once a
    module's output went NaN/Inf."""
    return _first_found(_named_inputs(args, kwargs), 2, _beyond_fp16)


def _named_inputs(args, kwargs):
    return [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]


def _nan_count(t):
    count = int(torch.isnan(t).sum())
    return f"{count} NaN of {t.numel()} values" if count else None


def _inf_count(t):
    count = int(torch.isinf(t).sum())
    if not count:
        return None
    positive = int((t == math.inf).sum())
    parts = [f"{n} {sign}Inf" for n, sign in ((positive, "+"), (count - positive, "-")) if n]
    return f"{' and '.join(parts)} of {t.numel()} values"


def _beyond_fp16(t):
    if t.dtype == torch.float16 or t.numel() == 0:
        return None
    magnitude = t.abs()
    beyond = torch.isfinite(magnitude) & (magnitude >= FP16_ROUNDS_TO_INF)
    count = int(beyond.sum())
    if not count:
        return None
    values = t[beyond]
    if count > 1 and float(values[0]) < 0 and bool((values == values[0]).all()):
        return None  # one negative fill (an attention mask's finfo(float32).min, -1e9): added, not data
    largest = float(magnitude[beyond].max())
    return f"{count} of {t.numel()} values at or beyond {FP16_ROUNDS_TO_INF:g}, max |x| {largest:g}"


class Found(typing.NamedTuple):
    """A tensor among a forward's arguments that a look described."""
    name: str            # "argument 0['x']"
    what: str            # what the look said of it: "1 NaN of 512 values"
    tensor: torch.Tensor

    def text(self, name: "str | None" = None) -> str:
        """'argument 0 (float32 [32, 16]): 1 NaN of 512 values' (`name` in place of its own)."""
        dtype = str(self.tensor.dtype).replace("torch.", "")
        return f"{name or self.name} ({dtype} {list(self.tensor.shape)}): {self.what}"


def _first_found(named, depth, look) -> "Found | None":
    """The first floating-point tensor in `named` (name, value) pairs, lists, tuples and
    dicts `depth` levels down included, that look(tensor) describes."""
    for name, value in named:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.layout is torch.strided:  # (not a sparse one's values)
                what = look(value.detach())
                if what:
                    return Found(name, what, value)
        elif depth > 0 and isinstance(value, (list, tuple, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            inner = _first_found([(f"{name}[{k!r}]", v) for k, v in items], depth - 1, look)
            if inner:
                return inner
    return None


def model_argument(tensor: torch.Tensor, args, kwargs) -> "str | None":
    """'argument 1' ("argument 'x'", "argument 0['feats']"): which of the model's arguments
    `tensor` is, or views; None where none is."""
    found = _first_found(_named_inputs(args, kwargs), 2, lambda t: "it" if shares_memory(tensor, t) else None)
    return found and found.name


def shares_memory(tensor: torch.Tensor, value) -> bool:
    """Whether `tensor` views the memory of a tensor in `value` (nested lists, tuples, dicts):
    the model's input reaching a module as it is, or viewed."""
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:
            return False
        storage = tensor.untyped_storage()
        return storage.nbytes() > 0 and storage.data_ptr() == value.untyped_storage().data_ptr()
    if isinstance(value, (list, tuple)):
        return any(shares_memory(tensor, v) for v in value)
    if isinstance(value, dict):
        return any(shares_memory(tensor, v) for v in value.values())
    return False


def host_sum(losses) -> float:
    """The sum of host losses (NaN for none), read at once: no device to wait for."""
    return math.fsum([t.item() for t in losses]) if losses else math.nan  # item(): exact for every float dtype


def sum_on(device, tensors) -> torch.Tensor:
    """The scalars summed as float64 on `device`, with device ops only (no sync)."""
    return torch.stack([t.reshape(()).to(device, torch.float64, non_blocking=True) for t in tensors]).sum()


def inf_checked(scaler) -> bool:
    """Whether gradients were unscaled and checked since the last update()."""
    return any(state.get("found_inf_per_device") for state in scaler._per_optimizer_states.values())


def found_inf_tensor(scaler) -> torch.Tensor:
    """found_inf summed over optimizers and devices, on the scale's device (no sync)."""
    return sum_on(scaler._scale.device, [v for state in scaler._per_optimizer_states.values()
                                         for v in state.get("found_inf_per_device", {}).values()])


def host_outcome(scaler) -> tuple:
    """(checked, found): whether gradients were unscaled and checked since the last
    update() (inf_checked), and whether any held NaN/Inf, for a host scale: read in one
    pass, every step."""
    checked = found = False
    for state in scaler._per_optimizer_states.values():
        per_device = state.get("found_inf_per_device")
        if per_device:
            checked = True
            for v in per_device.values():
                if not found:
                    found = bool(v.item())
    return checked, found


def host_scale(scaler) -> float:
    """An enabled scaler's host scale, as get_scale() reads it (the initial one before the
    first scale()), without its two calls."""
    scale = scaler._scale
    return float(scaler._init_scale) if scale is None else scale.item()


def scale_text(scale: float) -> str:
    """A loss scale as the report prints it: a whole power of two in full (init_scale=2**24
    is 16777216, where :g wrote 1.67772e+07), anything else as :g."""
    whole_power_of_two = 1.0 <= scale < 2.0 ** 53 and math.frexp(scale)[0] == 0.5
    return f"{scale:.0f}" if whole_power_of_two else f"{scale:g}"


def scale_on_device(scaler) -> bool:
    """Whether the scaler's scale lives on a CUDA device (reading it would wait)."""
    return scaler._scale is not None and scaler._scale.is_cuda


# Elementwise modules whose output is no larger than their input (|f(x)| <= |x|) or bounded
# (tanh, sigmoid, clamps), in the input's dtype: they cannot turn a finite value into NaN/Inf
# or use up headroom, so they can never be the module a finding names. Not hooked: a small
# model spends a third of its hooks on them.
_BOUNDED = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.GELU, torch.nn.SiLU, torch.nn.Mish, torch.nn.Hardswish,
            torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Hardtanh, torch.nn.Hardsigmoid, torch.nn.Softsign,
            torch.nn.Identity)


# Dropouts with p = 0 (a common config default) return their input itself, in training
# and in eval: they compute nothing. p is read once, at attach() time.
_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
             torch.nn.FeatureAlphaDropout)


def foreign_copy(module: torch.nn.Module) -> bool:
    """Whether a module that carries a hook but is not the one it was registered on is a
    copy to stand aside for: a deep copy of the model (an EMA, a mean teacher) carries
    torch's hooks and is not the watched module; a DataParallel replica (torch marks it
    _is_replica) is the watched module on another device."""
    return not getattr(module, "_is_replica", False)


def bounded_by_input(module: torch.nn.Module) -> bool:
    """Whether the module's output is bounded by its input (exact types: a subclass may add
    code of its own)."""
    kind = type(module)
    if kind in _BOUNDED:
        return True
    if kind in _DROPOUTS:
        return module.p == 0
    return kind is torch.nn.LeakyReLU and abs(module.negative_slope) <= 1.0
