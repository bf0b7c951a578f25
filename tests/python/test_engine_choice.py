"""Which engine reads a tensor, asked through the same interface the agent uses: the
session core picks by device, a CUDA tensor is handed over as (device, stream) and never
copied to the host. Runs without a GPU: the choice, not the kernels, is under test."""
import sqlite3

import pytest
import torch

import ampdiag
from ampdiag import _ampdiag
from ampdiag._tensors import engine_place, readable_view


def session():
    return _ampdiag.Session(overwrite=True, queue_capacity=1024, every=1, context_steps=0, threads=1, histogram=False)


def test_cpu_tensors_go_to_the_cpu_engine():
    t = torch.ones(4)
    assert engine_place(t) == (0, 0, 0)
    assert session().engine_for(*engine_place(t)[:2]) == "cpu"


def test_cuda_tensors_go_to_the_cuda_engine_in_a_cuda_build():
    built_with_cuda = _ampdiag.built_with_cuda()
    assert session().engine_for(1, 0) == ("cuda" if built_with_cuda else "none")
    assert session().engine_for(1, 3) == ("cuda" if built_with_cuda else "none")


def test_an_unreadable_tensor_is_copied_on_its_own_device():
    t = torch.ones(4, 4, dtype=torch.float64).t()
    view = readable_view(t)
    assert view.device == t.device and view.dtype == torch.float32 and view.is_contiguous()


def test_device_gradients_without_a_device_engine_get_one_event_and_no_host_read(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a real device would run the engine on these (bogus) pointers")
    s = session()
    s.add_layer(1, "w", "", "", "float32", "[4]", 4, True, "")
    s.layers_done()
    db = tmp_path / "run.db"
    s.open(str(db), 0, 1, "run")
    for _ in range(2):
        s.begin_cycle()
        # A device pointer the host may not read: the CPU engine would fault on it.
        assert not s.grads([0], [0x10], [4], [0], [1], [0], [0])
        s.end_step(1.0, 1, 1024.0, 1024.0, False, False, 0)
    s.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM grad_stats").fetchone()[0] == 0
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'slow-path'").fetchone()[0] == 1
        assert c.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 2


def test_status_counts_dropped_steps(tmp_path):
    model = torch.nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db") as handle:
        assert handle.status["dropped_steps"] == 0
