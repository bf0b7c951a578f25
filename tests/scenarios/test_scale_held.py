"""A loop that keeps its loss scale with scaler.update(new_scale=65536) each step, where the
classifier's gradients overflow: the scaler never lowers the scale, and every step is
skipped. The report named the head's overflow and told to pin it; it names the scale held
by hand first, and the same loop that lets the scaler lower it is healthy."""
import torch
from torch import nn

import ampdiag


def classifier_loop(db, hold):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 10))
    with torch.no_grad():
        model[2].weight.mul_(3)  # its gradients pass 65504 at 65536, not at 16384
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, opt, db=db):
        for step in range(30):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(64, 32, generator=g) * 10, torch.randint(0, 10, (64,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            if hold:
                scaler.update(new_scale=65536.0)
            else:
                scaler.update()
            opt.zero_grad()


def test_a_scale_held_by_update_new_scale_is_named_first(tmp_path, verdict):
    db = tmp_path / "run.db"
    classifier_loop(db, hold=True)
    code, report = verdict(db)
    assert code == 1
    first = report["findings"][0]
    assert (first["rule"], first["severity"]) == ("scale-held", "error")
    assert "scaler.update(new_scale=65536) set it, from step 0" in first["evidence"]
    assert "not scaler.update(new_scale=...)" in first["suggestions"][0]["python"]
    origin = next(f for f in report["findings"] if f["rule"] == "overflow-origin")
    assert origin["severity"] == "warning"
    assert origin["suggestions"][0]["summary"].startswith("The scale is held by hand (see scale-held)")


def test_the_same_loop_that_lets_the_scaler_lower_the_scale_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    classifier_loop(db, hold=False)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
