"""What the agent looks at once a step goes NaN/Inf, each once a step at most: the first
module whose output is NaN/Inf (its FP32 replay, then its enclosing modules', and the code a
module runs after its submodules), the batch, the parameters, and the loss code between the
model's outputs and the loss."""
import torch

from ._loss_code import loss_code, nodes_under, nonfinite_constants, path_nodes, with_numbers
from ._names import named_parameters
from ._parameters import eps_rounding_to_zero, nan_buffers, nonfinite_parameters
from ._replay import FINITE, INTRINSIC, NONFINITE
from ._tensors import DATA_LAYERS, beyond_fp16_in_inputs, first_float_tensor, float_tensors, holds_nonfinite, \
    inf_in_model_input, model_argument, nan_in_inputs

# Loss-code looks per run: each walks the step's graph from the loss to the outputs. Steps
# whose output gradient only overflowed fp16 take at most half, leaving the rest to NaN ones.
LOSS_CODE_LOOKS = 8
OVERFLOW_CODE_LOOKS = 4


def on_nonfinite_output(handle, path, module, args, kwargs, output):
    """A watched module's output (path "": the model's) holds NaN/Inf. The first time in a
    step: the batch, then the parameters, are read for NaN/Inf. Hooks fire as modules
    finish, a child before its parent: when the first module with a non-finite output is
    still NaN/Inf in FP32 (it only received NaN/Inf, or its parent's own code made it), its
    enclosing modules are replayed as they finish, until one is finite. Only a replay that
    ran and stayed NaN/Inf escalates."""
    handle._dropped.nonfinite_output(path)
    handle._forward_nonfinite = True
    # A module known to make NaN/Inf from finite inputs (a -inf mask, every step) says
    # nothing of the batch or the parameters: they are not read again for it.
    by_design = handle._replayer is not None and handle._replayer.known(path) == INTRINSIC
    if not handle._inputs_checked and not by_design:
        handle._inputs_checked = True
        where = None
        if handle._root_inputs is not None:
            where = nan_in_inputs(*handle._root_inputs)
            if where is None and isinstance(module, DATA_LAYERS) and args:
                where = inf_in_model_input(args[0], *handle._root_inputs)
        if where:
            # A corrupted batch: no module is to blame, and no replay is spent on it.
            handle._session.event("input-nan", where)
            handle._input_nan = True
        else:
            look_at_parameters(handle)
    if handle._replayer is None or handle._input_nan or handle._parameters_nonfinite:
        return
    if handle._first_nonfinite is None:
        handle._first_nonfinite = path
    elif not (handle._escalating and handle._first_nonfinite.startswith(path + ".")):
        return
    replays_now = handle._replayer.known(path) is None  # (else it was replayed, and looked at, before)
    handle._live = False  # the replay runs the module again: every hook stands aside
    try:
        verdict = handle._replayer.verdict(path, module, args, kwargs, output)
    finally:
        handle._live = handle._in_cycle and not handle._inert
    handle._escalating = verdict == NONFINITE
    if verdict == INTRINSIC:
        # It makes NaN/Inf from finite inputs in FP32 too (a -inf mask): no fp16 cause to
        # find above it, and the next module to go NaN/Inf in this step is looked at.
        handle._first_nonfinite = None
        buffers = nan_buffers(path, module, handle._finite_buffers)
        if buffers is not None:
            handle._event("buffers-nan", buffers)
        elif replays_now:
            look_at_own_code(handle, path, module, args, output)
    if verdict == FINITE and replays_now:
        look_at_input_range(handle, path, args, kwargs)
        look_at_own_code(handle, path, module, args, output)
    if verdict == NONFINITE and replays_now and path == handle._first_nonfinite:
        look_at_input_code(handle, path, args)
    if verdict == FINITE and handle._autopin is not None:
        handle._autopin.confirmed(path, module, handle._replayer.fp32_absmax(path))


MODULE_CODE_LOOKS = 4  # "module-code" and "input-code" events a run


def look_at_own_code(handle, path, module, args, output):
    """A module of the user's, or one with submodules, whose output its FP32 replay found
    finite (fp16's range, not its code) or NaN/Inf from finite inputs (its code: a flow's
    coupling whose exp() passes float32's range too): the operations its own code ran after
    its submodules' outputs and its inputs (event "module-code", "c2: Index:float16,
    IndexAdd:float16": a graph layer's sum over a hub's messages). torch's own leaves are
    one operation, which their type names; a module whose output is its last submodule's
    ran its own code before that one."""
    # Not torch's own leaves (a Linear's code is its one operation, which its type names), nor
    # one whose output is its last submodule's (attention's out projection): its own code does
    # not make the output, and the report places it between its submodules.
    if handle._last_output_path != path or (next(module.children(), None) is None
                                           and type(module).__module__.startswith("torch.")):
        return
    _read_code(handle, "module-code", path, first_float_tensor(output),
               [n for n in handle._module_nodes if n is not None] +
               [t.grad_fn for t in float_tensors(args) if t.grad_fn is not None])


def look_at_input_code(handle, path, args):
    """The first module to show NaN/Inf only received it (its FP32 replay was NaN/Inf too):
    the operations that made its first floating-point input since the modules before it
    finished, the code of whoever calls it (event "input-code", "dec.0: Mul:float16,
    Exp:float16, Mul:float16, Add:float16": a VAE's exp(0.5 * logvar) in its own forward()).
    None where that input is a module's output as it is, or the data."""
    tensor = first_float_tensor(args)
    stops = [n for n in handle._module_nodes if n is not None]
    if tensor is not None and any(n is tensor.grad_fn for n in stops):
        return  # a module's output, as it is: no code in between
    _read_code(handle, "input-code", path, tensor, stops)


def _read_code(handle, kind, path, tensor, stops):
    """Event `kind`, "PATH: Op:dtype, ...", of the operations that made `tensor` down to
    `stops` (nodes_under): once per kind and module, MODULE_CODE_LOOKS such reads a run."""
    key = (kind, path)
    if key in handle._module_code_read or len(handle._module_code_read) >= MODULE_CODE_LOOKS:
        return
    if tensor is None or tensor.grad_fn is None:
        return
    handle._module_code_read.add(key)
    code = loss_code(nodes_under(tensor.grad_fn, stops))
    if code is not None:
        handle._session.event(kind, f"{path}: {code}")


def look_at_input_range(handle, path, args, kwargs):
    """Once, where a module's FP32 replay was finite: whether its input held finite values
    that fp16 cannot hold, under float16 autocast, which casts them to Inf for its fp16 ops
    before the module computes anything (unnormalised features: prices, counts, raw sensor
    readings). Event "input-beyond-fp16" ('PATH: argument 0 (float32 [128, 64]): 37 of 8192
    values at or beyond 65520, max |x| 221847'); where that tensor is one of the model's
    arguments, or a view of it, named as the model's ("the model's argument 1 (...") and
    ending in '; the model's input': then the data is what to fix."""
    try:
        found = beyond_fp16_in_inputs(args, kwargs)
        if found is None:
            return
        device = found.tensor.device.type
        if not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16):
            return
        # Named as the model's argument where it is one (its forward(a, b) gives b to the module).
        argument = model_argument(found.tensor, *handle._root_inputs) if handle._root_inputs is not None else None
    except Exception:  # a look must never break the training: a tensor type it cannot read says nothing
        return
    text = found.text() if argument is None else found.text(f"the model's {argument}") + "; the model's input"
    handle._event("input-beyond-fp16", f"{path}: {text}")


def output_gradient(handle, grad):
    """The tensor hook on the model's output (see _forward.output_hook): one event in a step whose
    gradient arrived there NaN/Inf."""
    if handle._output_gradient_seen or handle._standing_aside:
        return None
    if not holds_nonfinite(handle._session, grad):
        return None
    handle._output_gradient_seen = True
    nan, inf = int(torch.isnan(grad).sum()), int(torch.isinf(grad).sum())
    dtype = str(grad.dtype).replace("torch.", "")
    if nan == 0 and grad.dtype == torch.float16:
        # The scaled gradient overflowing fp16 where it enters the output (a cast down from
        # the loss's float32), the scaler's to answer; or the loss code's own fp16 backward
        # (log's 1/p of a p near 0). The analyzer tells them apart by the loss code's dtypes
        # and the scales it recurs at, so the loss code is read here too.
        handle._session.event("output-gradient-overflow",
                            f"{dtype} {list(grad.shape)}: 0 NaN, {inf} Inf of {grad.numel()} values")
        look_at_loss_code(handle, OVERFLOW_CODE_LOOKS)
        return None
    handle._session.event("output-gradient-nonfinite",
                        f"{dtype} {list(grad.shape)}: {nan} NaN, {inf} Inf of {grad.numel()} values")
    look_at_loss_code(handle)
    if handle._gradient_entries is not None and handle._first_nonfinite is None:
        handle._gradient_entries.trace_loss_code()
    return None


def look_at_loss_code(handle, looks=LOSS_CODE_LOOKS):
    """In a step whose loss, or the gradient reaching the model's output, went NaN/Inf
    while no module's output did (nor the input, nor the parameters): event "loss-code",
    the operations between the outputs and the loss (see _loss_code.py), for the
    analyzer to name the one that makes NaN/Inf. A few per run: the loss code rarely
    changes: `looks` in all."""
    if (handle._loss_code_seen or handle._loss_code_looks >= looks or handle._first_nonfinite is not None
            or handle._input_nan or handle._parameters_nonfinite):
        return
    handle._loss_code_seen = True
    nodes = path_nodes(handle._loss_nodes, handle._loss_code_outputs)
    code = with_numbers(loss_code(nodes), handle._first_loss_code)
    if code is not None:
        handle._loss_code_looks += 1
        handle._session.event("loss-code", code)
        constant = nonfinite_constants(nodes)
        if constant is not None:
            handle._session.event("loss-input-nonfinite", constant)


def look_at_parameters(handle):
    """Once in a step that went NaN/Inf with a finite input, until found: whether an
    earlier update left NaN/Inf in the parameters (see _parameters.py)."""
    if handle._parameters_nonfinite:
        return
    where = nonfinite_parameters(named_parameters(handle._watched_model))
    if where is None:
        return
    handle._parameters_nonfinite = True
    handle._session.event("parameters-nonfinite", where)
    eps = eps_rounding_to_zero(list(handle._optimizers))
    if eps is not None:
        handle._session.event("optimizer-eps", eps)
