"""attach(profile=True): where CUPTI cannot run (this machine: no driver) it says so once and
training is untouched; where it runs, the agent's ranges cover each module's forward and
backward and the optimizer (checked here through the session's range calls)."""
import copy
import sqlite3
import subprocess

import torch

import ampdiag
from ampdiag import _ampdiag
from conftest import Tiny, train


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def test_unavailable_profiling_is_one_event_and_changes_no_number_of_the_training(tmp_path):
    without, _, _ = train(12)
    db = tmp_path / "run.db"
    with_it, _, handle = train(12, lambda m, s, o: ampdiag.attach(m, s, db=db, profile=True))
    assert all(torch.equal(a, b) for a, b in zip(without, with_it))
    if handle._session.profiling:  # a machine with a GPU and CUPTI: nothing to degrade
        return
    assert rows(db, "SELECT value FROM meta WHERE key = 'profiler'") == [("unavailable",)]
    events = rows(db, "SELECT detail FROM events WHERE kind = 'profiler-unavailable'")
    assert len(events) == 1
    assert "training goes on without it" in events[0][0]
    assert rows(db, "SELECT COUNT(*) FROM gpu_time") == [(0,)]


def test_the_report_says_profiling_was_unavailable_and_the_run_stays_healthy(tmp_path, ampdiag_cli):
    db = tmp_path / "run.db"
    _, _, handle = train(12, lambda m, s, o: ampdiag.attach(m, s, db=db, profile=True), init_scale=1024.0)
    if handle._session.profiling:
        return
    result = subprocess.run([ampdiag_cli, "report", str(db), "--fail-on", "error"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "device profile: unavailable (device profiling is unavailable, training goes on without it: " in result.stdout


class RecordingSession:
    """The real session, but profiling as if CUPTI ran: the range calls are recorded."""

    profiling = True

    def __init__(self, inner):
        self._inner = inner
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def begin_range(self, module, phase, kind):
        self.calls.append(("begin", module, phase, kind))
        return True

    def end_range(self):
        self.calls.append(("end",))


def test_ranges_cover_each_module_in_forward_and_backward_and_the_optimizer_step(tmp_path):
    recording = []

    def attach(model, scaler, optimizer):
        handle = ampdiag.attach(model, scaler, db=tmp_path / "run.db", profile=True)
        recording.append(RecordingSession(handle._session))
        handle._session = recording[0]
        return handle

    train(3, attach, init_scale=1024.0)
    calls = recording[0].calls
    depth = 0
    for call in calls:  # every range opened is closed, innermost first
        depth += 1 if call[0] == "begin" else -1
        assert depth >= 0
    assert depth == 0
    modules = {p: i for i, (p,) in enumerate(rows(tmp_path / "run.db", "SELECT path FROM modules ORDER BY id"))}
    begins = [c[1:] for c in calls if c[0] == "begin"]
    for path in ("a", "b", "c"):
        assert (modules[path], _ampdiag.PHASE_FORWARD, _ampdiag.KIND_FLOAT16) in begins  # autocast fp16
        assert (modules[path], _ampdiag.PHASE_BACKWARD, _ampdiag.KIND_FLOAT16) in begins
    assert begins.count((-1, _ampdiag.PHASE_OPTIMIZER, _ampdiag.KIND_OTHER)) >= 1
    # Backward runs from the loss: c's backward range opens before a's.
    order = [m for m, phase, _ in begins if phase == _ampdiag.PHASE_BACKWARD]
    assert order.index(modules["c"]) < order.index(modules["a"])


def test_without_profile_no_submodule_gets_a_pre_hook(tmp_path):
    model = Tiny()
    handle = ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "run.db")
    assert all(not m._forward_pre_hooks for m in model.modules() if m is not model)
    # The model's own: its inputs (for input-nan) and, until its first training forward,
    # autocast's dtype (amp_dtype).
    assert len(model._forward_pre_hooks) == 2
    handle.close()
    profiled = ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "profiled.db", profile=True)
    assert all(m._forward_pre_hooks for m in (model.a, model.b, model.c))
    profiled.close()
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_a_deep_copy_of_the_model_opens_no_range(tmp_path):
    # An EMA or a teacher deep-copied after attach carries the hooks; its forward is not
    # the watched model's and gets no range under its modules' names.
    model = Tiny()
    handle = ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "run.db", profile=True)
    handle._session = RecordingSession(handle._session)
    copy.deepcopy(model)(torch.randn(4, 16))
    assert handle._session.calls == []
    model(torch.randn(4, 16))
    assert [c[0] for c in handle._session.calls].count("begin") == 3
    handle.close()
