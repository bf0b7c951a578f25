"""attach(profile=True) on a CUDA model: CUPTI starts, and gpu_time holds the first
Linear's device time in forward and in backward and the optimizer's, on several sampled
steps. Skipped without a CUDA device. scripts/cuda-check runs it on its own, under a time
limit: on the first GPU lent (an H100), two tests of the whole tests/python suite had not
finished after two and a half minutes, and the profile=True ones are the suspects."""
import sqlite3

import pytest
import torch

from test_cuda import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")


def test_profile_on_cuda_records_device_time_per_module_in_forward_backward_and_optimizer(tmp_path):
    db = tmp_path / "run.db"
    train(6, db=db, init_scale=1024.0, profile=True)  # a scale that does not overflow: the optimizer steps
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM meta WHERE key = 'profiler' AND value = 'unavailable'").fetchone()[0] == 0, \
            "CUPTI did not start on this device"
        (linear,) = c.execute("SELECT id FROM modules WHERE path = '0'").fetchone()
        phases = {p for (p,) in c.execute("SELECT DISTINCT phase FROM gpu_time WHERE module_id = ?", (linear,))}
        optimizer_ns = c.execute("SELECT SUM(ns) FROM gpu_time WHERE phase = 3").fetchone()[0]
        steps = c.execute("SELECT COUNT(DISTINCT step) FROM gpu_time").fetchone()[0]
    assert {0, 1} <= phases  # the first Linear's kernels, in forward and in backward
    assert optimizer_ns and optimizer_ns > 0
    assert steps >= 3
