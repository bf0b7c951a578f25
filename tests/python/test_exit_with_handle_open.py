"""A script that never closes its attach() handle: the interpreter's exit closes it, and
the run.db it leaves is complete."""
import sqlite3
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    import ampdiag

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    handle = ampdiag.attach(model, scaler, db=sys.argv[1])  # never closed
    for _ in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
""")


def test_a_script_that_exits_with_its_handle_open_leaves_every_step_and_a_closed_run(tmp_path, ampdiag_cli):
    db = tmp_path / "open.db"
    ran = subprocess.run([sys.executable, "-c", SCRIPT, str(db)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM steps").fetchone() == (5,)
    report = subprocess.run([ampdiag_cli, "report", str(db), "--fail-on", "error"], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr  # not "was not closed" (exit 2)
