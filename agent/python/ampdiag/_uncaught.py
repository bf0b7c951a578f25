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

from ._names import named_modules

_open = weakref.WeakSet()
_previous = None  # the hook _hook replaced


def ended_by(handle, kind, error):
    """Closes `handle`, first recording `kind`/`error` where the training raised (kind None:
    it ended normally)."""
    handle._raised = kind is not None
    if kind is not None and not handle._closed and not handle._inert:
        text = str(error).strip()
        handle._session.event("training-raised", kind.__name__ + (": " + text.splitlines()[0][:300] if text else ""))
        module = raised_in(handle, error)
        if module:
            handle._session.event("training-raised-in", module)
    handle.close()


def raised_in(handle, error) -> str:
    """"rnn (LSTM)": the innermost module of the attached model whose code the traceback
    ran through (a method with the module as `self`), so that the report can name what
    refused (oneDNN's float16 LSTM); "" where none did. Read once, from the frames."""
    root = getattr(handle, "_watched_model", None)
    traceback = getattr(error, "__traceback__", None)
    if root is None or traceback is None:
        return ""
    paths = {id(module): path for path, module in named_modules(root) if path}
    found = ""
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        path = paths.get(id(owner)) if owner is not None else None
        if path is not None:
            found = f"{path} ({type(owner).__name__})"
        traceback = traceback.tb_next
    return found


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
