"""`ampdiag fp8` on a recorded training run: the vit_overflow model with exponent histograms,
and the activations' histograms against the module outputs torch itself computed."""
import json
import struct
from collections import defaultdict

import torch
from torch import nn

import ampdiag as agent
from conftest import rows as sql_rows
from test_whatif_rerun import train

HIST_MIN_EXP, HIST_MAX_EXP = -40, 20
HIST_BINS = HIST_MAX_EXP - HIST_MIN_EXP + 3


def exponent_histogram(t):
    """run.db's bins (docs/FORMAT.md), computed here with torch: finite non-zero |x| by binade."""
    x = t.detach().float().abs().flatten()
    x = x[torch.isfinite(x) & (x > 0)]
    _, exponent = torch.frexp(x)  # x = m * 2^exponent, m in [0.5, 1): floor(log2 x) = exponent - 1
    bins = (exponent - 1 - HIST_MIN_EXP + 1).clamp(0, HIST_BINS - 1)
    return torch.bincount(bins, minlength=HIST_BINS).tolist()


def test_fp8_readiness_lists_every_layer_and_e5m2_holds_at_least_what_e4m3_holds(tmp_path, ampdiag):
    db = tmp_path / "hist.db"
    train(65536.0, 10, db=db, histogram=True)
    result = ampdiag("fp8", db, "--format", "json")
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    for tensor, expected in [("gradient", 28), ("activation", None)]:  # 28: every parameter of the model
        rows = [r for r in table if r["tensor"] == tensor]
        assert rows and (expected is None or len(rows) == expected)
        for row in rows:  # both put the largest value in their top binade; E5M2 has 30 binades, E4M3 15
            assert float(row["e5m2_normal_pct"]) >= float(row["e4m3_normal_pct"])
        e5m2 = [float(r["e5m2_normal_pct"]) for r in rows]
        assert e5m2 == sorted(e5m2)  # least ready first
    modules = {path for (path,) in sql_rows(db, "SELECT path FROM modules")}
    assert {r["name"] for r in table if r["tensor"] == "activation"} <= modules
    text = ampdiag("fp8", db).stdout
    assert "layers fit E4M3" in text and "modules fit E4M3" in text


def test_activation_histograms_are_the_module_outputs_binades(tmp_path):
    """Every act_stats histogram equals the one computed here from the output torch handed
    to a forward hook of the same module, call by call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[2].weight.mul_(300.0)  # outputs up in fp16's upper binades, some beyond
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    db = tmp_path / "acts.db"
    handle = agent.attach(model, scaler, db=db, histogram=True, activation_every=1)  # every step's outputs
    seen = defaultdict(list)  # (step, module path) -> histograms, in call order
    step = [0]
    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(lambda m, i, out, name=name: seen[(step[0], name)].append(exponent_histogram(out)))
    x = torch.randn(32, 16)
    for step[0] in range(4):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    handle.close()

    recorded = defaultdict(list)
    for s, path, blob in sql_rows(db, "SELECT a.step, m.path, a.histogram FROM act_stats a JOIN modules m "
                                      "ON m.id = a.module_id ORDER BY a.step, a.fwd_order"):
        assert blob is not None and len(blob) == 4 * HIST_BINS
        recorded[(s, path)].append(list(struct.unpack(f"<{HIST_BINS}I", blob)))
    assert {path for _, path in recorded} >= {"0", "1", "2", "4"}
    assert {s for s, _ in recorded} == {0, 1, 2, 3}
    for key, histograms in recorded.items():
        assert histograms == seen[key], key


def test_a_run_without_histograms_is_refused_with_how_to_record_them(tmp_path, ampdiag):
    db = tmp_path / "plain.db"
    train(65536.0, 10, db=db)
    result = ampdiag("fp8", db)
    assert result.returncode == 2
    assert "histogram=True" in result.stderr
