"""The gradients a step's statistics are taken from, and the one call that hands them to
the engines (with the fused unscale's scale where it applies)."""
import torch

from ._tensors import DTYPE_CODE, distributed, engine_place, fast_place, readable_view


def optimizer_gradients(handle, optimizer):
    """(layer ids, gradients to read, whether any was sparse) of the optimizer's
    parameters that have a gradient. A sparse gradient is read through its values."""
    layers, grads, sparse = [], [], False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            layer = handle._layer_id(p)
            if grad.is_sparse:
                sparse = True
                handle._event("sparse-gradient", f"layer {layer} has sparse gradients: statistics cover their "
                                                 "stored values", key=("sparse", layer))
                grad = grad._values()
            elif type(grad) is not torch.Tensor and distributed(grad):
                # The analyzer then compares no ranks layer by layer and, where no hook saw
                # the gradients arrive, names no first layer.
                handle._event("sharded-parameters", "the gradients are DTensors (FSDP2's fully_shard): each rank's "
                              "statistics cover its own shards", key=("sharded",))
            layers.append(layer)
            grads.append(grad)
    if not handle._unreached.done:
        handle._unreached.check(optimizer, layers)
    return layers, grads, sparse


def post_stats(handle, layers, grads, inv_scale=None, device_scale=None):
    """Hands the gradients to the engine that reads their device, in place where the layout
    allows; returns whether a host gradient held NaN/Inf (device ones land with the step).
    inv_scale (host) or device_scale (pointers to inv_scale and found_inf on the device):
    the fused unscale, in the same pass. No gradients: nothing to hand over, False."""
    if not grads:
        return False
    ptrs, numels, codes, types, indices, streams = [], [], [], [], [], []
    copies = []  # dense copies, alive until the engine has read them
    for layer, g in zip(layers, grads):
        fast = fast_place(g)
        if fast is not None:  # the common case, cheapest first
            ptr, numel, code, *place = fast
        else:
            v = readable_view(g)
            if v is not g:
                copies.append(v)
                handle._event("slow-path", f"layer {layer} has a {g.dtype} {g.device} gradient: its statistics are "
                                           f"taken on a dense copy on {g.device}", key=("copy", layer))
            ptr, numel, code = v.data_ptr(), v.numel(), DTYPE_CODE[v.dtype]
            place = engine_place(v)
        ptrs.append(ptr)
        numels.append(numel)
        codes.append(code)
        types.append(place[0])
        indices.append(place[1])
        streams.append(place[2])
    return handle._session.grads(layers, ptrs, numels, codes, types, indices, streams, inv_scale, device_scale)
