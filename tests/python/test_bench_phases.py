"""bench/python_attach_phases.py measures attach() by replacing its hook factories: it
must still find them and its variants must still attach and train, or its table would
silently measure something else (the script checks that its pass-less variant recorded no
activation rows where the shipped loop did)."""
import subprocess
import sys

from conftest import ROOT


def test_phase_benchmark_runs_every_variant_and_prints_its_table():
    ran = subprocess.run([sys.executable, str(ROOT / "bench" / "python_attach_phases.py"), "--width", "16",
                          "--turns", "4"], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    rows = [line for line in ran.stdout.splitlines() if line.startswith("| ") and not line.startswith("| loop")]
    assert [row.split(" | ")[0][2:] for row in rows] == [
        "without ampdiag", "attach (activations on)", "module hooks without the pass over outputs",
        "model's hooks only open the cycle", "both: dispatch and the cycle only", "attach, no activations"]
    assert all(len(row.split("|")) == 9 for row in rows)  # a loop name and six phases
