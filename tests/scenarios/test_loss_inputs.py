"""NaN/Inf the loss is given rather than makes: a missing regression target, or advantages a
policy-gradient loop normalises in float16 outside the model. Named as the loss's input,
with the masking or the FP32 fix, never as the loss code's or a layer's."""
import torch
from torch import nn

from conftest import rules
from fp16_loop import train


def regression_with_missing_targets(db, mask_them):
    """Every fifth batch holds a missing target (NaN); the report's fix masks it out."""
    torch.manual_seed(0)

    def loss_of(step, model):
        x = torch.randn(32, 16)
        y = x[:, :1] * 2
        if step % 5 == 2:
            y[7] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x).float()
        keep = torch.isfinite(y).all(-1) if mask_them else slice(None)
        return nn.functional.mse_loss(out[keep], y[keep])

    train(db, nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)), 15, loss_of)


def test_a_nan_regression_target_is_named_as_the_losss_input_not_its_code(tmp_path, verdict):
    db = tmp_path / "nan_target.db"
    regression_with_missing_targets(db, mask_them=False)
    code, rep = verdict(db)
    assert code == 1
    top = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert top["title"].startswith("The loss is NaN/Inf because MseLoss's target already held NaN/Inf")
    assert [s["python"].splitlines()[0] for s in top["suggestions"]] == [
        "keep = torch.isfinite(y).all(-1)  # or fix the data: assert torch.isfinite(y).all()"]


def test_masking_the_missing_targets_as_the_report_says_trains_healthy(tmp_path, verdict):
    db = tmp_path / "masked_target.db"
    regression_with_missing_targets(db, mask_them=True)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)


def test_advantages_normalised_in_float16_outside_the_model_are_named_with_the_fp32_fix(tmp_path, verdict):
    # A policy-gradient loss whose advantages are normalised under autocast: (a - mean) /
    # (std + 1e-8) with 1e-8 = 0 in fp16 is 0/0 = NaN when every return of the batch is equal.
    # The NaN is a constant the loss was given, but fp16's: the report must not clear fp16.
    db = tmp_path / "ppo.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        obs, actions, returns = torch.randn(64, 16), torch.randint(0, 4, (64,)), torch.randn(64)
        if step % 8 == 5:
            returns = torch.ones(64)
        with torch.autocast("cpu", dtype=torch.float16):
            adv = returns.half()
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            logp = model(obs).log_softmax(-1).gather(1, actions[:, None]).squeeze(1)
            ratio = (logp - logp.detach()).exp()
            return -(ratio * adv).mean()

    train(db, nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)), 16, loss_of)
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"]) == (1, "forward-nonfinite")
    assert first["title"].endswith("a float16 tensor made outside the model: not the model or the loss code")
    assert first["suggestions"][0]["summary"].startswith("Mul's other was float16: where the loop computes it under "
                                                         "autocast, compute it in FP32")
