"""Precision lost without NaN/Inf: a hand-written RMSNorm (as Llama-style model code writes
it) fed activations above 256 computes x.pow(2) beyond fp16's range, rsqrt(Inf) = 0, and
hands on rows of zeros. The loss scale stays steady and nothing is NaN, so without the
precision checks the report was healthy. Trained through the real GradScaler, judged
through the CLI; and loops that lose nothing get no such finding, in fp16 and in bf16."""
import re

import torch
from torch import nn

import ampdiag
from conftest import amp_training, rows, rules


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def sensor_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), RMSNorm(128), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))


def train_sensor(db, pin=None, **options):
    """Raw sensor readings (hundreds) into a Linear and the RMSNorm, 20 fp16 AMP steps;
    `options` for attach() besides checks on every step."""
    model = sensor_model()
    if pin:
        ampdiag.pin_fp32(model.get_submodule(pin))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp_training(db, model, opt, 20, lambda g: nn.functional.mse_loss(
        model(torch.randn(64, 16, generator=g) * 300).float(), torch.randn(64, 1, generator=g)),
        precision_budget=1.0, **options)


def encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(64, 1))


def test_a_norm_that_zeroes_its_rows_in_fp16_is_an_error_with_its_pin(tmp_path, verdict):
    train_sensor(tmp_path / "run.db")
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    assert ("precision-loss", "1") in rules(rep, "error")
    lost = next(f for f in rep["findings"] if f["rule"] == "precision-loss")
    assert "came out exactly 0 where FP32's were not" in lost["evidence"]
    assert lost["suggestions"][0]["python"].startswith("ampdiag.pin_fp32(model[1])")


def test_the_pinned_norm_trains_the_same_loop_without_the_finding(tmp_path, verdict):
    train_sensor(tmp_path / "run.db", pin="1")
    code, rep = verdict(tmp_path / "run.db")
    assert "precision-loss" not in [rule for rule, _ in rules(rep)]
    assert code == 0, [f["title"] for f in rep["findings"]]


def test_an_fp16_transformer_checked_every_step_has_no_precision_finding(tmp_path, verdict):
    model = encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp_training(tmp_path / "run.db", model, opt, 30, lambda g: nn.functional.mse_loss(
        model(torch.randn(8, 16, 64, generator=g)).mean(1).float(), torch.randn(8, 1, generator=g)),
        precision_budget=1.0)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]


def test_a_bf16_transformer_checked_every_step_has_no_precision_finding(tmp_path, verdict):
    model = encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with ampdiag.attach(model, optimizer=opt, db=tmp_path / "run.db", precision_budget=1.0):
        for _ in range(30):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(torch.randn(8, 16, 64, generator=g)).mean(1).float(),
                                              torch.randn(8, 1, generator=g))
            loss.backward()
            opt.step()
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]


def test_autopin_pins_the_norm_its_check_found_lossy_and_later_checks_find_it_whole(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_sensor(db, autopin=True)
    assert rows(db, "SELECT step, detail FROM events WHERE kind = 'autopin'") == [(2, "1")]  # checked at step 1
    assert all(error < 1e-3 for (error,) in rows(db, "SELECT rel_error FROM precision_checks WHERE module = '1' "
                                                     "AND step >= 2"))
    code, rep = verdict(db)
    pinned = next(f for f in rep["findings"] if f["rule"] == "autopin")
    assert pinned["evidence"].startswith("a precision check found its float16 output 100 % away from FP32")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]


def test_weights_far_too_large_before_the_norm_are_named_with_the_norm_that_loses_their_outputs(tmp_path, verdict):
    # The same norm after a Linear whose weights start 300 times too large, on readings of
    # ordinary size: the norm's zeroed rows send no gradient back, so the Linear's gradient is
    # mostly exact zeros. The report said a tanh or a softmax after it saturated.
    model = sensor_model()
    with torch.no_grad():
        model[0].weight.mul_(300)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp_training(tmp_path / "run.db", model, opt, 20, lambda g: nn.functional.mse_loss(
        model(torch.randn(64, 16, generator=g)).float(), torch.randn(64, 1, generator=g)), precision_budget=1.0)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    oversized = next(f for f in rep["findings"] if f["rule"] == "oversized-weights")
    assert oversized["title"].endswith("and 1, which takes its outputs, loses its output to float16"), oversized["title"]
    lost = next(f for f in rep["findings"] if f["rule"] == "precision-loss")
    assert re.search(r"its input comes from 0, whose weights start at a gain of 17\d \(see oversized-weights\)$",
                     lost["evidence"]), lost["evidence"]
    assert lost["suggestions"][1]["python"].startswith('model.get_submodule("0").reset_parameters()')
