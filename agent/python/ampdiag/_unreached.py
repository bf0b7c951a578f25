"""Parameters an optimizer holds whose gradient never arrived: a backward from the loss
that does not reach them (torch.utils.checkpoint with use_reentrant=True over an input that
needs no gradient, a detach() in forward). The statistics are read at the optimizer's
gradients, so a parameter the optimizer does not hold (a frozen backbone, linear probing)
is no such parameter, while one it holds without a gradient is: event
"parameters-unreached" after CHECKS reads of the gradients (or at close(), from 5 on),
"12480 of 12805 values, 6 of 8 parameters the optimizers hold: blocks.0.0.weight, ...".
Cost: while some parameter waits, a dict pop for each gradient read; once each has arrived
(the first step, as a rule), nothing."""
from ._names import named_parameters

CHECKS = 20
_AT_CLOSE = 5
_NAMED = 64


class UnreachedParameters:
    def __init__(self, handle):
        self._handle = handle
        self._waiting = {}       # layer -> (name, numel): held by an optimizer, no gradient yet
        self._optimizers = set()  # id() of those whose parameters were added
        self._count = self._values = 0
        self._checks = 0
        self.done = False

    def check(self, optimizer, layers):
        """The gradients of `optimizer` read now are those of `layers`."""
        if id(optimizer) not in self._optimizers:
            self._add(optimizer)
        for layer in layers:
            self._waiting.pop(layer, None)
        self._checks += 1
        if not self._waiting:
            self.done = True
        elif self._checks >= CHECKS:
            self._write()

    def close(self):
        if not self.done and self._checks >= _AT_CLOSE:
            self._write()

    def _add(self, optimizer):
        self._optimizers.add(id(optimizer))
        model = self._handle._layers.model()
        names = {id(p): name for name, p in named_parameters(model)} if model is not None else {}
        layer_id = self._handle._layer_id
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad or id(p) not in names:
                    continue
                layer = layer_id(p)
                if layer in self._waiting:
                    continue
                self._waiting[layer] = (names[id(p)], p.numel())
                self._count += 1
                self._values += p.numel()

    def _write(self):
        self.done = True
        unreached = sorted(self._waiting.items())
        values = sum(numel for _, (_, numel) in unreached)
        listed = ", ".join(name for _, (name, _) in unreached[:_NAMED])
        more = f" and {len(unreached) - _NAMED} more" if len(unreached) > _NAMED else ""
        self._handle._session.event(
            "parameters-unreached", f"{values} of {self._values} values, {len(unreached)} of {self._count} parameters "
                                    f"the optimizers hold: {listed}{more}")
