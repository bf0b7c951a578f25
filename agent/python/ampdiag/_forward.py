"""The agent's forward hook: every watched module's output, on every step (statistics on
the full steps, a NaN/Inf check on the others, forward order, the first non-finite module
and its FP32 replay); for a compiled model, the module it compiled and hooks kept out of
its graph."""
import sys
import time
import weakref

import torch

from ._loss_code import loss_code, made_dtype, path_nodes
from ._chained_calls import ChainProbe
from ._looks import on_nonfinite_output, output_gradient
from ._tensors import (DTYPE_CODE, activation_elsewhere, first_float_tensor, float_tensors, foreign_copy,
                       holds_nonfinite)

# torch.compile traces a compiled model's module hooks into its graph. Ours read and set
# the agent's state and call its extension, which Dynamo can neither put in a graph nor
# guard: it warned at every call into the extension and recompiled the hooks for each
# module path and each value of a flag. So the hooks of a compiled model are wrapped in
# torch.compiler.disable, which runs them, and all they call, outside Dynamo (one graph
# break at each watched module, which per-module statistics need anyway). The wrapper
# costs ~0.4 µs a call, and making one imports Dynamo (seconds), so an eager model's hooks
# stay plain. A model compiled after attach() is found out by the hooks themselves:
# is_compiling() is a constant while Dynamo traces and a ~0.2 µs call otherwise; traced, a
# hook does nothing but say so (AttachHandle writes the event "compiled-after-attach").
compiling = torch.compiler.is_compiling


def outside_compiled_graph(hook):
    """`hook` as torch.compile runs it: outside the graph, itself and what it calls."""
    return torch.compiler.disable(hook)


def watched_root(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose paths a run names: for a torch.compile'd model the module it
    compiled, so that the run says `encoder.0`, as for the uncompiled model, and not
    `_orig_mod.encoder.0` (the compiled wrapper forwards attribute lookups, so
    `model.encoder` and get_submodule("encoder") still reach it)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # loaded by whoever compiled the model
    if dynamo is not None and isinstance(model, getattr(dynamo, "OptimizedModule", ())):
        original = getattr(model, "_orig_mod", None)
        if isinstance(original, torch.nn.Module):
            return original
    return model


def compiled_fullgraph(model: torch.nn.Module) -> bool:
    """Whether torch.compile(model, fullgraph=True) made `model`. Newer torch keeps the flag
    on the compiled wrapper's context; torch 2.5 only in the frame converter it chose
    (ConvertFrameAssert, whose `_one_graph` is the flag)."""
    context = getattr(model, "dynamo_ctx", None)
    if context is None:
        return False
    if hasattr(context, "fullgraph"):
        return bool(context.fullgraph)
    converter = getattr(getattr(context, "callback", None), "_torchdynamo_orig_callable", None)
    return bool(getattr(converter, "_one_graph", False))


def compiled_in_place(root: torch.nn.Module) -> bool:
    """Whether Module.compile() compiled the model, or a part of it, in place."""
    return any(module.__dict__.get("_compiled_call_impl") is not None for module in root.modules())


def input_hook(handle, owner):
    """The model's forward pre-hook: keeps the step's inputs, which are looked at only once
    an output goes NaN/Inf (a NaN already in the batch is the data's, not fp16's), and opens
    the step's cycle when the model's forward begins with gradients on: a submodule it runs
    under no_grad (a frozen backbone feeding a trained head) is part of the training step,
    not an evaluation between steps, and its outputs are recorded."""

    def hook(module, args, kwargs):
        if compiling():
            handle._traced_by_compile = True
            return None
        if module is owner or not foreign_copy(module):
            handle._in_root_forward = True
            handle._root_inputs = (args, kwargs)
            handle._module_nodes = []  # this forward's: an evaluation with gradients on keeps no graph alive
            if not handle._live and torch.is_grad_enabled():
                handle._begin_forward_cycle()
            elif not handle._live and handle._evaluations.applies(module):
                handle._evaluations.forward_began()
        return None

    return hook


_ENTRY_WALK = 20000  # graph nodes walked, once a run, to find the output the loss starts from


def entry_output(floats) -> int:
    """The index in `floats` (the model's floating-point outputs) of the first one that
    requires grad and that no other output is computed from. Features returned beside the
    logits that a head made from them receive the head's backward too: NaN/Inf the model's
    own backward makes there is no look at where backward starts. A graph too large to walk
    whole counts what was walked."""
    starts = [t.grad_fn for t in floats]
    below = set()  # id() of the nodes one edge or more under an output
    held = []      # every node seen, so that no id() is handed to another (see path_nodes)
    todo = [n for n in starts if n is not None]
    while todo and len(held) < _ENTRY_WALK:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is not None and id(child) not in below:
                below.add(id(child))
                held.append(child)
                todo.append(child)
    for i, node in enumerate(starts):
        if floats[i].requires_grad and (node is None or id(node) not in below):
            return i
    return 0


def output_hook(handle, owner):
    """The model's forward hook: on a training step, watches the gradient that reaches the
    model's first floating-point output in backward that no other output is computed from
    (entry_output). NaN/Inf there was made between the output and the loss (the loss
    code's backward: the gradient of sqrt(0), of a division by 0), before any module: event
    "output-gradient-nonfinite", which the analyzer names instead of the first layer the
    NaN/Inf reached. Not for a float16 gradient holding Inf and no NaN: that may be the
    scaled gradient overflowing fp16 where it enters the output (`.float()`'s backward
    casts it), which is fp16's. Host outputs only: a device check would wait for the
    device."""

    entry = None  # (how many float outputs, the index of the one whose gradient is watched)

    def on_gradient(grad):
        return output_gradient(handle, grad)

    def watch_gradient(tensor):
        node = tensor.grad_fn
        if node is None:  # a leaf the model returns as it is
            tensor.register_hook(on_gradient)
            return
        # The node's pre-hook sees the same gradient as the tensor's hook (which torch keeps
        # as a pre-hook of that node), registered for a few µs less: this runs every step.
        nr = tensor.output_nr
        node.register_prehook(lambda grads: None if grads[nr] is None else output_gradient(handle, grads[nr]))

    def hook(module, args, kwargs, output):
        nonlocal entry
        if compiling():
            handle._traced_by_compile = True
            return None
        # Listed once: read twice below, on every step (a plain tensor needs no walk).
        floats = ([output] if output.is_floating_point() else []) if type(output) is torch.Tensor \
            else float_tensors(output)
        if handle._live and handle._dropped.finite_so_far() and torch.is_grad_enabled():
            look_at_model_output(handle, owner, args, kwargs, output, floats)
        if module is owner or not foreign_copy(module):
            handle._in_root_forward = False
        if module is owner:
            handle._module_nodes, handle._last_node = [], None  # looked at: held no longer than the forward
        handle._dropped.forward_ended(output, module.training)
        if not handle._live and handle._evaluations.applies(module) and (module is owner or not foreign_copy(module)):
            handle._evaluations.model_output(output)
            return None
        if not handle._live or not torch.is_grad_enabled() or (module is not owner and foreign_copy(module)):
            return None
        tensor = floats[0] if len(floats) == 1 else None
        if len(floats) > 1:  # which one: walked once for each number of outputs
            if entry is None or entry[0] != len(floats):
                entry = (len(floats), entry_output(floats))
            tensor = floats[entry[1]]
        if tensor is not None and tensor.requires_grad and tensor.is_cpu:
            watch_gradient(tensor)
        # Where the loss code begins, should it go NaN/Inf (one forward's: an evaluation
        # run with gradients on must not keep every graph alive).
        handle._output_nodes = [t.grad_fn for t in floats if t.grad_fn is not None]
        # A model that returns its loss beside its logits (Hugging Face's, given labels): the
        # loss code runs from the logits through that loss, which the loop may divide further.
        made = [t.grad_fn for t in floats if t.grad_fn is not None and t.numel() > 1]
        handle._loss_code_outputs = made if made and len(made) < len(handle._output_nodes) else handle._output_nodes
        return None

    return hook


# Operations whose output holds only values of their input, each finite where it was:
# views, copies, and casts to float32 (a cast down to half can overflow: read).
_MOVES = frozenset(("View", "UnsafeView", "Reshape", "ReshapeAlias", "ToCopy", "Permute", "Transpose", "T", "Squeeze",
                    "Unsqueeze", "Clone", "Expand", "Slice", "Select", "Contiguous", "Alias", "Flatten"))
_MOVE_HOPS = 8


def moved_from(node, source) -> bool:
    """Whether autograd's `node` reaches `source` through operations of _MOVES alone."""
    for _ in range(_MOVE_HOPS):
        if node is None or source is None:
            return False
        if node is source:
            return True
        name = node.name().rstrip("0123456789").removesuffix("Backward")
        if name not in _MOVES or len(node.next_functions) != 1 or name == "ToCopy" and made_dtype(node) != "float32":
            return False
        node = node.next_functions[0][0]
    return False


def _version(tensor):  # (the forward hook has the same inline: it runs for every module)
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor (torch.inference_mode) has no version counter
        return None


MODEL_CODE_LOOKS = 4  # "model-code" events a run: the model's code rarely changes


def look_at_model_output(handle, owner, args, kwargs, output, floats):
    """Where every module's output was finite: the model's own output, if it is not the last
    module's (a model that computes after its last submodule, as an LM whose logits are
    F.linear(h, self.emb.weight) with the embedding's weight). NaN/Inf there was made by
    the model's own forward(), not by the loss code: recorded as the output of module ""
    (the model), with its FP32 replay, as a submodule's would be, and the operations from
    the last module's output to the model's (event "model-code", as the loss code's). Host
    outputs only: a device check would wait for the device. `floats`: the output's
    floating-point tensors (float_tensors)."""
    # A scalar is a loss the model computes itself (a Hugging Face model's output holds it
    # first): the loss code's look (_look_at_loss_code) reads that one.
    tensor = None
    for t in floats:  # (a loop: a generator is one more call a tensor, every step)
        if t.dim() > 0:
            tensor = t
            break
    if tensor is None or not tensor.is_cpu or DTYPE_CODE.get(tensor.dtype) is None:
        return
    last = handle._last_output
    if last is not None and last() is tensor and _version(tensor) == handle._last_version:
        return  # the last module's output, looked at by its own hook
    if moved_from(tensor.grad_fn, handle._last_node):
        return  # its values, viewed or cast (logits.float().view(-1, V)): nothing new to look at
    handle._own_uses.watch(tensor.grad_fn, handle._module_nodes)
    if not holds_nonfinite(handle._session, tensor):
        return
    if handle._model_code_looks < MODEL_CODE_LOOKS:
        code = loss_code(path_nodes([tensor.grad_fn], [handle._last_node]))
        if code is not None:
            handle._model_code_looks += 1
            handle._session.event("model-code", code)
            from ._own_uses import own_parameters  # here: it imports _tied, which imports this module
            mine = {id(p): name for name, p in owner.named_parameters(recurse=False)}
            used = own_parameters(tensor.grad_fn, handle._module_nodes, mine) if mine else None
            if used is not None:
                handle._session.event("model-parameters", used)
    activation_elsewhere(handle._session, handle._module_id("", owner, args), tensor, handle._micro_batch)
    on_nonfinite_output(handle, "", owner, args, kwargs, output)


def forward_hook(handle, path, owner, root):
    module_id = None  # resolved on the first call, when the module first runs
    probe, probing = ChainProbe(), True  # whether its calls are chained: the first two forwards only
    # Runs for every watched module on every step, between torch's kernels: in a training
    # loop each object it looks up costs cache misses (~20 µs a hook in all, where a warm
    # microbenchmark says 1), so the common case (a recording cycle, a contiguous host
    # output) is inline, with what it calls bound here; the rest goes through helpers.
    # Measured in docs/PERFORMANCE.md.
    activation, now, tensor_type, code_of, strided, ref, traced = (handle._session.activation, time.perf_counter_ns,
                                                                   torch.Tensor, DTYPE_CODE.get, torch.strided,
                                                                   weakref.ref, compiling)
    evaluations = handle._evaluations
    in_backward = torch._C._current_graph_task_id  # -1 outside autograd's backward

    def hook(module, args, kwargs, output):
        nonlocal module_id, probing
        if traced():
            handle._traced_by_compile = True
            return None
        # Recording a deep copy's forward (an EMA's) would blame the module for the copy.
        if module is not owner and foreign_copy(module):
            return None
        if not handle._live and (handle._standing_aside or not handle._begin_part_cycle(root)):
            if evaluations.armed and not handle._standing_aside:  # an evaluation between steps
                evaluations.module_output(path, output)
            return None
        if in_backward() != -1:
            # A checkpointed block running its forward again for the backward: the values
            # its first forward had, recorded then.
            return None
        if handle._backward_seen:
            handle._backward_seen = False
            if handle._grad_calls != handle._batch_grad_calls:  # the backward reached the model
                handle._batch_grad_calls = handle._grad_calls
                handle._micro_batch += 1  # a forward after a backward: the next micro-batch
        t0 = now()
        tensor = output if type(output) is tensor_type else first_float_tensor(output)
        code = None if tensor is None else code_of(tensor.dtype)
        if code is None and (tensor is None or not tensor.is_floating_point()):
            handle._python_ns += now() - t0
            return None
        if module_id is None:
            module_id = handle._module_id(path, module, args)  # listed, with or without rows
        if probing:
            probing = probe.looking(handle, path, args, kwargs, tensor)
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor (torch.inference_mode) has no version counter
            version = None
        last = handle._last_output
        seen = last is not None and last() is tensor
        if seen and version is not None and version == handle._last_version:
            # The tensor the last hook read, unchanged (a container returning its last
            # child's output): the same statistics, and the child comes first in forward
            # order. Only an escalating replay still needs the enclosing module.
            if handle._last_nonfinite:
                on_nonfinite_output(handle, path, module, args, kwargs, output)
        elif seen or not (args and args[0] is tensor):  # else it returned its input: it computed nothing
            # (A seen tensor changed in place since, as a residual block's `out += x`, is read again.)
            if (code is not None and tensor.is_contiguous() and tensor.layout is strided and tensor.is_cpu
                    and type(tensor) is tensor_type):
                nonfinite = activation(module_id, tensor.data_ptr(), tensor.numel(), code, handle._micro_batch, 0,
                                       0, 0)
            else:
                nonfinite = activation_elsewhere(handle._session, module_id, tensor, handle._micro_batch)
            handle._last_output = ref(tensor)
            handle._last_output_path = path
            handle._last_node = tensor.grad_fn
            handle._module_nodes.append(tensor.grad_fn)
            handle._last_version = version
            handle._last_nonfinite = nonfinite
            if nonfinite:
                on_nonfinite_output(handle, path, module, args, kwargs, output)
        handle._python_ns += now() - t0
        return None

    return hook
