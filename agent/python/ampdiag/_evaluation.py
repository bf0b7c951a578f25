"""Evaluations between the training steps: a validation pass under torch.no_grad() or
torch.inference_mode(), the model in eval mode. Nothing of it is recorded, yet fp16
overflows there as in training (a longer sequence, an input the training never saw), and
with every training step finite the report would read healthy while each validation loss is
NaN. Such a forward costs one NaN/Inf check of the model's output. Once an output went
NaN/Inf, the evaluation forwards after it also check each watched module's output until the
first NaN/Inf, which names the module. Event "evaluation-output-nonfinite" at each step
whose evaluation went NaN/Inf: the first module's path, "" where every module's output was
finite (the model's own forward() made it), or "(not looked at)" for the first (no module
was checked yet). At most one event an optimizer step and EVENTS a run; after that nothing
is checked. Only NaN and +Inf count: -inf is what a mask writes by design (logits of classes
a decoder may not emit), and an overflow that makes -inf makes +Inf or NaN beside it or
after it."""
import torch

from ._tensors import first_float_tensor, float_tensors, holds_nonfinite

EVENTS = 8
KIND = "evaluation-output-nonfinite"
NOT_LOOKED_AT = "(not looked at)"


class Evaluations:
    def __init__(self, handle):
        self._handle = handle
        self.armed = False        # an evaluation's output went NaN/Inf: modules are checked too
        self._first = None        # this forward's first module whose output held NaN/Inf
        self._events = 0
        self._reported_step = None

    @staticmethod
    def applies(module) -> bool:
        """Whether the model's forward running now is an evaluation between the steps."""
        return not module.training and not torch.is_grad_enabled()

    def _overflowed(self, tensor) -> bool:
        """NaN or +Inf in a host tensor: the activations' check first (one pass, and all a
        finite tensor costs), torch's to tell a mask's -inf apart."""
        if not holds_nonfinite(self._handle._session, tensor):
            return False
        return bool(torch.isnan(tensor).any()) or bool(torch.isposinf(tensor).any())

    def forward_began(self):
        self._first = None

    def module_output(self, path, output):
        """A watched module's output, in an evaluation forward while armed."""
        if self._first is not None:
            return
        tensor = first_float_tensor(output)
        if tensor is not None and tensor.is_cpu and self._overflowed(tensor):
            self._first = path

    def model_output(self, output):
        """The model's output, at the end of an evaluation forward."""
        first, self._first = self._first, None
        if self._events >= EVENTS:
            return
        outputs = [t for t in float_tensors(output) if t.is_cpu]
        if not any(self._overflowed(t) for t in outputs):
            return
        session = self._handle._session
        if session.step == self._reported_step:
            return
        session.event(KIND, (first or "") if self.armed else NOT_LOOKED_AT)
        self._reported_step = session.step
        self._events += 1
        self.armed = self._events < EVENTS
