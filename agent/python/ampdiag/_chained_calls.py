"""Whether a module is run again and again in one forward, each call taking the last one's
output: ALBERT's shared layer, a cell called in a loop over time steps, a block reused by
hand. Its parameters receive their gradient only once every call's backward has run, and a
NaN/Inf one call's backward makes reaches the calls before it through their outputs: so the
first of those parameters to hold NaN/Inf says neither which call made them nor where in it
(event `chained-calls`, whose detail is the module's path; the analyzer then names the
block). Two calls of one encoder on two inputs (a contrastive loss's views) are not
chained: each call's backward is its own.

Looked at in the first two forwards that reach the module's hook, then never again: one
flag test a call after that. The C++ agent does the same for modules run through its
forward() (agent/src/chained_calls.h)."""
import weakref

from ._tensors import is_or_views


def _given(value, previous) -> bool:
    """`value`, an argument, or one of a tuple's (an LSTM's (h, c)), is `previous` or views it."""
    return is_or_views(value, previous) or type(value) in (tuple, list) and any(is_or_views(v, previous) for v in value)


class ChainProbe:
    __slots__ = ("_forward", "_output")

    def __init__(self):
        self._forward = None  # (step, micro-batch) of the call before
        self._output = None   # weakref to that call's output

    def looking(self, handle, path, args, kwargs, output) -> bool:
        """One call of the module at `path`, `output` its first floating-point output. Returns
        whether to go on looking: False once it is known (an event if chained)."""
        forward = (handle._session.step, handle._micro_batch)
        if self._forward is not None:
            if self._forward != forward:
                return False  # a second forward: the first one ran it once, or unchained
            previous = self._output()
            if previous is not None and (any(_given(a, previous) for a in args) or
                                         any(_given(v, previous) for v in kwargs.values())):
                handle._event("chained-calls", path)
                return False
        self._forward = forward
        self._output = weakref.ref(output)
        return True
