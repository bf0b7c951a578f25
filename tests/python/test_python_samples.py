"""The Python samples: ordinary PyTorch fp16 training scripts; `ampdiag report` names the
planted module exactly, marks the replay-confirmed pin, and the pinned run is healthy."""
import os
import subprocess
import sys

import pytest

from conftest import SAMPLES, run_sample

CASES = {
    "vit_overflow.py": ("overflow-origin", "block1.0.attn", ""),
    "linear_attention_nan.py": ("forward-nonfinite", "encoder.0.linear_attn", "confirmed"),
    "camera_projection.py": ("forward-nonfinite", "projection", "confirmed"),
}


@pytest.mark.parametrize("sample", sorted(CASES))
def test_report_names_the_planted_module(sample, tmp_path, report):
    db = tmp_path / "run.db"
    run_sample(sample, "--db", db)
    code, rep = report(db)
    assert code == 1
    rule, module, confirmation = CASES[sample]
    first = rep["findings"][0]
    assert (first["rule"], first["module"], first["confirmation"]) == (rule, module, confirmation)
    if rule == "forward-nonfinite":  # each skipped step's cause names the same module, not a child
        assert {s["forward_module"] for s in rep["skipped_steps"]} == {module}


@pytest.mark.parametrize("sample", sorted(CASES))
def test_pinned_sample_is_healthy(sample, tmp_path, report):
    db = tmp_path / "run.db"
    run_sample(sample, "--db", db, "--pin-fp32", CASES[sample][1])
    code, rep = report(db)
    assert code == 0 and rep["healthy"]


def test_half_weights_sample_is_flagged_for_stalled_updates_and_its_fp32_master_run_is_healthy(tmp_path, report):
    run_sample("half_weights.py", "--db", tmp_path / "half.db", "--steps", "40")
    code, rep = report(tmp_path / "half.db")
    assert code == 0  # a warning: training goes on, it only learns less
    stalled = [f for f in rep["findings"] if f["rule"] == "stalled-updates"]
    assert len(stalled) == 1 and stalled[0]["layer"].endswith(".weight")
    run_sample("half_weights.py", "--db", tmp_path / "master.db", "--steps", "40", "--fp32-master")
    code, rep = report(tmp_path / "master.db")
    assert code == 0 and rep["healthy"]
    assert not [f for f in rep["findings"] if f["rule"] in ("stalled-updates", "half-parameters")]


def test_two_rank_ddp_run_writes_one_db_per_rank_read_together(tmp_path, report):
    # TMPDIR: torchrun's log directory (torchelastic_*) goes with the test's, not into /tmp for good.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SAMPLES), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
                    str(SAMPLES / "ddp_vit.py"), "--db", str(tmp_path / "ddp.db"), "--steps", "20"],
                   check=True, capture_output=True, text=True, timeout=300, env=env)
    dbs = sorted(tmp_path.glob("ddp.rank*.db"))
    assert [p.name for p in dbs] == ["ddp.rank0.db", "ddp.rank1.db"]
    code, rep = report(*dbs)
    assert code == 1
    assert [r["rank"] for r in rep["runs"]] == [0, 1]
    first = rep["findings"][0]
    assert first["module"] == "module.block1.0.attn" and first["ranks"] == [0, 1]
