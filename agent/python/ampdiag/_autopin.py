"""Self-healing pins (attach(autopin=N)): a module whose FP32 replay confirmed it as the
origin of a non-finite forward value runs in FP32 from the next optimizer cycle on, with an
`autopin` event (its detail is the module path, which the report reads) so the user can
make the pin permanent in code. Never a module whose replay was not confirmed, never more
than N modules."""
from ._pin import pin_fp32


class AutoPinner:
    def __init__(self, handle, limit: int):
        self._handle = handle
        self._limit = limit
        self._waiting = []  # (path, module): confirmed this cycle, pinned when the next begins
        self._done = set()
        self._announce = []  # pinned, their events posted when the next cycle begins

    def confirmed(self, path, module):
        """The replay of `module` was finite: pin it from the next cycle (within the limit)."""
        if path in self._done or any(p == path for p, _ in self._waiting):
            return
        if len(self._done) + len(self._waiting) >= self._limit:
            self._handle._event("autopin-limit", f"{path} was confirmed too, but autopin={self._limit} modules are "
                                "pinned already; pin it in code if the report names it", key=("autopin-limit",))
            return
        self._waiting.append((path, module))

    def pin(self):
        """After a step ended: the modules confirmed in it run in FP32 from the next step."""
        for path, module in self._waiting:
            pin_fp32(module)
            self._handle._pinned.append(module)
            self._done.add(path)
            self._announce.append(path)
        self._waiting.clear()

    def announce(self):
        """At the start of the next cycle: the events, at the step the pins apply from."""
        for path in self._announce:
            self._handle._session.event("autopin", path)
        self._announce.clear()
