"""Values computed on a device, read on the host without the training thread waiting: each
is copied to pinned memory on its device's current stream and handed on once a CUDA event
says the copy has landed (looked at a later step, waited for at close()). Host values are
handed on at once. The agent's device looks all read back this way: the stale-gradient
probe, fused SGD's new momentum, the weights' norms, the precision checks and the
half-precision updates."""
import torch


def on_device(t) -> bool:
    """Whether reading `t` would wait for a device (a module function: the tests take the
    device path on host tensors through it)."""
    return t.is_cuda


class DeviceReads:
    def __init__(self, deliver):
        """`deliver(values, what)`: the values as Python numbers (tolist()), `what` as sent."""
        self._deliver = deliver
        # (CUDA event, pinned copy, what) on their way, in the order sent: false when none is.
        # A plain list, not a property: the looks ask it every step, and a property is one
        # more Python call each time.
        self.pending = []

    def send(self, values, what):
        if not on_device(values):
            self._deliver(values.tolist(), what)
            return
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(values.device))
        self.pending.append((event, host, what))

    def poll(self, wait=False) -> bool:
        """Hands on what has landed (everything, waiting for it, with `wait`); whether
        nothing is left on its way."""
        landing, self.pending = self.pending, []
        for i, entry in enumerate(landing):
            event, host, what = entry
            try:
                if wait:
                    event.synchronize()
                elif not event.query():
                    self.pending.append(entry)
                    continue
                self._deliver(host.tolist(), what)
            except BaseException:
                # The entry whose delivery raised is not delivered again; the ones after it
                # wait, in order, for the next poll.
                self.pending.extend(landing[i + 1:])
                raise
        return not self.pending
