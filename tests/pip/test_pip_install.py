"""`pip install` of the project into a fresh virtual environment, then a Python sample
and `ampdiag report` from that environment only.

torch (5 GB with its CUDA libraries) is not downloaded again: the fresh environment sees
the project's environment's site-packages through a .pth file, and pip installs with
--no-build-isolation --no-deps, so nothing is fetched."""
import json
import os
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pip_install_then_sample_then_report(tmp_path):
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, ampdiag = venv / "bin" / "python", venv / "bin" / "ampdiag"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "ampdiag_test_torch.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AMPDIAG_CLI")}
    installed = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-q", str(ROOT)],
                               capture_output=True, text=True, timeout=1500, env=env)
    assert installed.returncode == 0, installed.stderr[-4000:]

    where = subprocess.run([python, "-c", "import ampdiag; print(ampdiag.__file__)"], capture_output=True, text=True,
                           env=env)
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(venv)), where.stdout  # the installed package, not the build tree

    db = tmp_path / "cam.db"
    sample = subprocess.run([python, ROOT / "samples" / "python" / "camera_projection.py", "--db", db, "--steps", "5"],
                            capture_output=True, text=True, timeout=300,
                            env=dict(env, PYTHONPATH=str(ROOT / "samples" / "python")))
    assert sample.returncode == 0, sample.stderr
    result = subprocess.run([ampdiag, "report", db, "--format", "json"], capture_output=True, text=True, env=env)
    assert result.returncode == 1, result.stderr
    first = json.loads(result.stdout)["findings"][0]
    assert (first["rule"], first["module"], first["confirmation"]) == ("forward-nonfinite", "projection", "confirmed")
