"""ampdiag: find the layer that breaks mixed-precision training.

    handle = ampdiag.attach(model, scaler, db="run.db")
    ...  # train as usual: autocast forward, scaler.scale(loss).backward(), scaler.step(opt), scaler.update()
    handle.close()                     # or use it as a context manager
    # then, in a shell: ampdiag report run.db

See attach() for the options and pin_fp32() for the usual fix.
"""
import torch  # noqa: F401  first: the extension then shares torch's OpenMP runtime

from ._ampdiag import RunDbError
from ._attach import AttachHandle, attach
from ._pin import pin_fp32, unpin_fp32

__all__ = ["attach", "AttachHandle", "pin_fp32", "unpin_fp32", "RunDbError"]
__version__ = "0.1.0"
