"""The exception that ends a training, recorded in its run.db (event "training-raised").

Inside attach()'s with-block, __exit__ sees it. A loop written as the package's docstring
shows, `handle = attach(...)` at the top and `handle.close()` at the end, never reaches
close() when it raises: the program ends through sys.excepthook, and the report would say
only that the loop never reached its update. So while a handle is open, sys.excepthook is
wrapped (once; the hook it replaced still runs after), and an exception nobody caught
closes every open handle as the with-block would.
"""
import sys
import weakref

_open = weakref.WeakSet()
_previous = None  # the hook _hook replaced


def ended_by(handle, kind, error):
    """Closes `handle`, first recording `kind`/`error` where the training raised (kind None:
    it ended normally)."""
    handle._raised = kind is not None
    if kind is not None and not handle._closed and not handle._inert:
        text = str(error).strip()
        handle._session.event("training-raised", kind.__name__ + (": " + text.splitlines()[0][:300] if text else ""))
    handle.close()


def watch(handle):
    global _previous
    _open.add(handle)
    if sys.excepthook is not _hook:
        _previous = sys.excepthook
        sys.excepthook = _hook


def unwatch(handle):
    _open.discard(handle)


def _hook(kind, error, traceback):
    for handle in list(_open):
        try:
            ended_by(handle, kind, error)
        except Exception:  # the program is ending: its own traceback matters more
            pass
    (_previous or sys.__excepthook__)(kind, error, traceback)
