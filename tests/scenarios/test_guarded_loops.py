"""Forwards whose loss never reaches backward. Loops that guard their step with
`if not torch.isfinite(loss): continue`, as detection and LLM codebases do: the batch whose
forward overflowed fp16 is dropped before the scaler sees it, so no step is skipped. The
report must name the module that overflowed as it does for the plain loop, not say the
model absorbed it, and its fix must train without a dropped batch. And a validation pass
with model.eval() but without torch.no_grad(): an overflow there trains nothing, a warning."""
import torch
from torch import nn

import ampdiag

BAD_STEPS = (5, 13)


class SelfSimilarity(nn.Module):
    """Mixes tokens by their dot products: on a batch of large activations the dot products
    pass 65504 in fp16 and the softmax of Inf - Inf is NaN; in FP32 they fit."""

    def forward(self, x):
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mix, self.head = nn.Linear(16, 32), SelfSimilarity(), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.mix(self.inp(x))).mean(1)


def guarded_loop(db, steps=20, pin=False):
    """Returns how many batches the guard dropped."""
    torch.manual_seed(0)
    model = Mixer()
    if pin:
        ampdiag.pin_fp32(model.mix)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(3)
    dropped = 0
    with ampdiag.attach(model, scaler, db=db):
        for step in range(steps):
            x, y = torch.randn(8, 6, 16, generator=g), torch.randn(8, 1, generator=g)
            if step in BAD_STEPS:
                x = x * 100.0  # an outlier batch
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            if not torch.isfinite(loss):
                dropped += 1
                continue
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return dropped


def test_a_guard_that_drops_nan_losses_is_told_which_module_overflowed_not_that_it_was_absorbed(tmp_path, verdict):
    db = tmp_path / "guarded.db"
    assert guarded_loop(db) == len(BAD_STEPS)
    code, rep = verdict(db)
    assert code == 1, rep["findings"]
    top = rep["findings"][0]
    assert (top["rule"], top["module"], top["severity"], top["confirmation"]) == \
        ("forward-nonfinite", "mix", "error", "confirmed")
    assert "the loop dropped the batch in 2 steps before backward" in top["evidence"]
    assert "absorbed" not in top["evidence"]
    assert top["steps"] == [BAD_STEPS[0]]


def test_the_report_header_counts_the_batches_the_guard_dropped(tmp_path, verdict, ampdiag):
    # No step counts them: the header said "18 steps, 1 skipped" for a loop that lost two more.
    db = tmp_path / "guarded.db"
    dropped = guarded_loop(db)
    _, rep = verdict(db)
    assert rep["runs"][0]["dropped_batches"] == dropped
    header = ampdiag("report", db).stdout.splitlines()[1]
    assert f" skipped, {dropped} batches dropped by the loop (NaN/Inf forward, no backward)," in header


def test_the_pin_the_report_gives_trains_the_guarded_loop_without_dropping_a_batch(tmp_path, verdict):
    db = tmp_path / "pinned.db"
    assert guarded_loop(db, pin=True) == 0
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    assert not [f for f in rep["findings"] if f["rule"] == "forward-nonfinite"]


def test_an_overflow_in_a_validation_pass_without_no_grad_is_a_warning_that_says_so(tmp_path, verdict):
    db = tmp_path / "validated.db"
    torch.manual_seed(0)
    model = Mixer()
    opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(3)
    with ampdiag.attach(model, scaler, db=db):
        for step in range(12):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(torch.randn(8, 6, 16, generator=g)).float(), torch.randn(8, 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if step % 4 == 3:
                model.eval()  # torch.no_grad() forgotten
                with torch.autocast("cpu", dtype=torch.float16):
                    model(torch.randn(8, 6, 16, generator=g) * (100.0 if step == 7 else 1.0))
                model.train()
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    forward = [f for f in rep["findings"] if f["rule"] == "forward-nonfinite"]
    assert [(f["module"], f["severity"]) for f in forward] == [("mix", "warning")]
    assert "it went NaN/Inf in an evaluation" in forward[0]["evidence"]
    assert "dropped" not in forward[0]["evidence"] and "absorbed" not in forward[0]["evidence"]
