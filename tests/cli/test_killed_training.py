"""A real training process killed with SIGKILL mid-run leaves a run.db that the CLI reads
with --allow-partial (at most the last uncommitted batch is lost); without it, one clear
line and exit code 2."""
import signal

from conftest import committed_steps, training_in_background


def test_sigkilled_training_leaves_a_readable_run(samples_dir, run, tmp_path):
    db = tmp_path / "killed.db"
    proc = training_in_background(samples_dir, db, 30)
    try:
        seen = committed_steps(db)
        assert seen >= 30, "the sample did not write steps while running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    refused = run("report", db)
    assert refused.returncode == 2 and "was not closed" in refused.stderr

    partial = run("report", db, "--allow-partial", "--format", "json")
    assert partial.returncode == 1  # the run itself is unhealthy, as the sample intends
    import json

    report = json.loads(partial.stdout)
    assert report["runs"][0]["steps"] >= seen  # nothing committed before the kill is lost
    assert report["findings"][0]["module"] == "block1.0.attn"
    assert "state:           not finished" in run("info", db).stdout
