"""Forwards that went NaN/Inf and got no backward: a loop that guards its step with
`if not torch.isfinite(loss): continue` drops the batch before the scaler sees its loss,
so no step is skipped and no gradient goes NaN/Inf, yet the batch was lost to the same
overflow a plain loop would have skipped a step for. The analyzer must not read such a
forward as one whose NaN/Inf the model absorbed (event "forward-dropped"). Nor is a forward
of the model in eval mode with gradients on (a validation pass without torch.no_grad()) a
dropped batch: it trains nothing, and is event "evaluation-nonfinite"."""
import torch

from ._tensors import float_tensors


class DroppedForwards:
    """Per optimizer cycle: each forward whose outputs went NaN/Inf, and whether a gradient
    reached any of its outputs before the step ended. Costs nothing in a forward that stays
    finite: the tensor hooks are registered only after a NaN/Inf output."""

    def __init__(self):
        self._first_nonfinite = None  # the first module whose output went NaN/Inf in this forward
        self._watched = []            # [first module, reached] per NaN/Inf forward of this cycle
        self._evaluations = []        # first module of each NaN/Inf forward in eval mode

    def nonfinite_output(self, path):
        if self._first_nonfinite is None:
            self._first_nonfinite = path

    def finite_so_far(self) -> bool:
        """Whether no module's output has gone NaN/Inf in the forward running now."""
        return self._first_nonfinite is None

    def forward_ended(self, output, training=True):
        """The model's forward returned `output`: a NaN/Inf forward's outputs get a hook that
        marks the gradient's arrival. An output nothing can differentiate (a forward under
        no_grad) is not watched: no backward could reach it."""
        path, self._first_nonfinite = self._first_nonfinite, None
        if path is None:
            return
        if not training:
            self._evaluations.append(path)
            return
        outputs = [t for t in float_tensors(output) if t.requires_grad]
        if not outputs or not torch.is_grad_enabled():
            return
        entry = [path, False]

        def reached(grad):
            entry[1] = True
            return None

        for t in outputs:
            t.register_hook(reached)
        self._watched.append(entry)

    def step_ended(self):
        """At the step's end: the events its NaN/Inf forwards call for, as (kind, detail),
        then forgets the cycle."""
        if not self._watched and not self._evaluations:  # every step's case, twice a step
            self._first_nonfinite = None
            return ()
        dropped = [path for path, reached in self._watched if not reached]
        events = []
        if dropped:
            events.append(("forward-dropped", f"{_forwards(dropped)} got no backward before the step ended: the "
                                              "loop dropped the batch"))
        if self._evaluations:
            events.append(("evaluation-nonfinite", f"{_forwards(self._evaluations)} ran with the model in eval mode "
                                                   "and gradients on (an evaluation without torch.no_grad())"))
        self._watched, self._evaluations = [], []
        self._first_nonfinite = None
        return events


def _forwards(paths) -> str:
    first = paths[0] or "the model's own forward()"
    forwards = "1 forward" if len(paths) == 1 else f"{len(paths)} forwards"
    return f"{forwards} whose output went NaN/Inf (first at {first})"
