"""A float16 gradient reaching the model's output that holds Inf and no NaN: the scaled
gradient overflowing fp16 where it enters the output (the scaler's to answer), or the loss
code's own fp16 backward making values above 65504 (log's 1/p of a p near 0), which no
loss scale avoids. The agent writes both (event "output-gradient-overflow") with the loss
code; the report names the loss code only for the second."""
import torch
from torch import nn

from conftest import rows


def focal_steps(db, fp32_loss=False, steps=20):
    """A focal loss written out on the fp16 sigmoid of a classifier's logits (Adam, inputs 6
    times too large): once the logits pass ~10, log(p)'s fp16 backward sends Inf into the
    classifier's output while the loss is still finite, at scales down to 32; later the loss
    itself goes NaN."""
    import ampdiag  # (the scenario's `ampdiag` fixture is the CLI)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    opt, scaler = torch.optim.Adam(model.parameters(), lr=0.05), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x, y = torch.randn(64, 32) * 6, (torch.rand(64, 10) < 0.1).float()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            with torch.autocast("cpu", enabled=not fp32_loss):
                p = torch.sigmoid(logits.float() if fp32_loss else logits)
                loss = (-(1 - p) ** 2 * y * torch.log(p) - p ** 2 * (1 - y) * torch.log(1 - p)).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_a_focal_losss_fp16_backward_overflowing_into_the_output_is_named_as_the_loss_not_the_last_layer(
        tmp_path, verdict):
    db = tmp_path / "focal.db"
    focal_steps(db)
    assert rows(db, "SELECT COUNT(*) FROM events WHERE kind = 'output-gradient-overflow'")[0][0] >= 2
    code, rep = verdict(db)
    assert code == 1
    found = {f["rule"]: f for f in rep["findings"]}
    assert "overflow-origin" not in found, found.get("overflow-origin", {}).get("title")
    backward = found["loss-backward"]
    assert backward["severity"] == "error"
    assert "held Inf at loss scales down to 32" in backward["suggestions"][0]["summary"]
    assert "autocast(device_type=out.device.type, enabled=False)" in backward["suggestions"][0]["python"]
    assert "see loss-backward" in found["scale-collapse"]["suggestions"][0]["summary"]


def test_the_fp32_loss_the_report_gives_first_trains_the_focal_loop_healthy(tmp_path, verdict):
    db = tmp_path / "focal_fp32.db"
    focal_steps(db, fp32_loss=True)
    code, rep = verdict(db)
    assert code == 0, [f["title"] for f in rep["findings"]]
