"""NaN/Inf that is not fp16's doing in a module: made in the loss the user computes (or in a
float16 tensor the loop computes for it outside the model), or
already in the batch. Named as such, never blamed on the layer nearest to it or on the
model's own code."""
import csv
import io
import math
import re
import subprocess

import pytest
import torch
from torch import nn

import ampdiag
from conftest import rows, rules
from fp16_loop import train


def random_regression(batch):
    """A `loss_of` for train(): the fp16 MSE of the model on a random batch of 16 features
    against random targets."""

    def loss_of(step, model):
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.functional.mse_loss(model(torch.randn(batch, 16)).float(), torch.randn(batch, 1))

    return loss_of


def test_a_log_of_zero_in_the_loss_is_blamed_on_the_loss_not_on_a_layer(tmp_path, verdict, cli):
    # Every fifth batch has a class whose probability the loss masks to 0: log(0) = -inf.
    db = tmp_path / "log0.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        with torch.autocast("cpu", dtype=torch.float16):
            p = torch.softmax(model(torch.randn(64, 16)).float(), -1)
        return -torch.log(p * (step % 5 != 3)).mean()

    train(db, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), 20, loss_of)
    code, rep = verdict(db)
    assert code == 1
    top = rep["findings"][0]
    assert (top["rule"], top["severity"], top["module"]) == ("forward-nonfinite", "error", "")
    assert "every probed module's output is finite" in top["title"]
    # The loss code is read from autograd's graph: the log is named, and as the loss already
    # ran in float32, casting the output to float is not offered.
    assert "ToCopy, Softmax, Mul, Log, Mean, Neg (all float32)" in top["evidence"]
    assert "clamp_min(1e-12).log()" in top["suggestions"][0]["python"]
    assert not any(".float()" in s["python"] for s in top["suggestions"])
    assert [(rule, module) for rule, module in rules(rep, "error") if module] == []  # no layer blamed
    assert [k["step"] for k in rep["skipped_steps"]] == [3, 8, 13, 18]
    assert {k["forward_source"] for k in rep["skipped_steps"]} == {"loss"}
    out = subprocess.run([cli, "timeline", str(db), "--format", "csv"], capture_output=True, text=True, check=True).stdout
    timeline = csv.DictReader(io.StringIO(out))
    assert {row["step"]: row["first_nonfinite_forward"] for row in timeline if row["skipped"] == "1"} == \
        {"3": "(loss)", "8": "(loss)", "13": "(loss)", "18": "(loss)"}


def test_a_float16_loss_is_a_warning_with_the_fp32_loss_fix_and_the_run_stays_healthy(tmp_path, verdict):
    # `.mean()` keeps autocast's fp16: its gradient is the scale in fp16, Inf at 65536, so
    # the first step and every growth probe back to 65536 skip.
    db = tmp_path / "half_loss.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(64, 16)).pow(2).mean()
        assert loss.dtype == torch.float16
        return loss

    train(db, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), 16, loss_of, growth_interval=5)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    half = [f for f in rep["findings"] if f["rule"] == "half-loss"]
    assert len(half) == 1 and half[0]["severity"] == "warning"
    assert ".float()" in half[0]["suggestions"][0]["python"]
    assert all(k["scale"] == 65536 for k in rep["skipped_steps"])  # only the scale's own gradient overflowed
    assert "overflow-origin" not in {f["rule"] for f in rep["findings"]}  # not blamed on the last layer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.enc(x)))


def test_a_nan_in_the_batch_is_blamed_on_the_data_not_on_the_models_forward(tmp_path, verdict, cli):
    db = tmp_path / "nan_batch.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        x, y = torch.randn(32, 16), torch.randn(32, 1)
        if step % 10 == 5:
            x[3, 7] = float("nan")  # one corrupted sample
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.functional.mse_loss(model(x).float(), y)

    train(db, Net(), 16, loss_of, init_scale=1024)
    code, rep = verdict(db)
    assert code == 1
    assert rules(rep, "error") == [("input-nan", "")]
    assert "1 NaN of 512 values" in rep["findings"][0]["evidence"]
    assert "forward-nonfinite" not in {f["rule"] for f in rep["findings"]}  # not the model's own code
    assert [(k["step"], k["forward_source"]) for k in rep["skipped_steps"]] == [(5, "input"), (15, "input")]
    assert rows(db, "SELECT COUNT(*) FROM replays") == [(0,)]  # no module's one replay spent on the data
    page = tmp_path / "nan_batch.html"
    subprocess.run([cli, "report", str(db), "--format", "html", "-o", str(page)], capture_output=True)
    offenders = re.search(r'class="ptitle">Top offenders<.*?</svg>', page.read_text(), re.S).group(0)
    assert re.findall(r'text-anchor="end">([^<]*)<title>', offenders) == ["(the model's input)"]  # not enc.0


def test_an_inf_in_log_power_features_is_blamed_on_the_data_not_on_the_models_forward(tmp_path, verdict):
    # log(power + 1e-10) computed under fp16 autocast before the model: 1e-10 rounds to 0
    # in fp16, so a silent frame's log is -inf. The model's own code makes nothing.
    db = tmp_path / "log_power.db"
    torch.manual_seed(0)
    filterbank = nn.Linear(128, 16, bias=False)

    def loss_of(step, model):
        frames, y = torch.randn(32, 128) * 0.01, torch.randn(32, 1)
        frames[:4] = 0.0  # silence
        with torch.autocast("cpu", dtype=torch.float16):
            x = torch.log(filterbank(frames).pow(2) + 1e-10).detach()
            return nn.functional.mse_loss(model(x).float(), y)

    train(db, Net(), 12, loss_of)
    code, rep = verdict(db)
    assert code == 1
    inputs = [f for f in rep["findings"] if f["rule"] == "input-nan"]
    assert inputs and inputs[0]["title"].startswith("The model's input already held Inf")
    assert re.search(r"\(argument 0 \(float16 \[32, 16\]\): \d+ -Inf of 512 values\)", inputs[0]["evidence"])
    assert "forward-nonfinite" not in {f["rule"] for f in rep["findings"]}
    collapse = [f for f in rep["findings"] if f["rule"] == "scale-collapse"]
    assert collapse and collapse[0]["suggestions"][0]["summary"].startswith("Fix the Inf in the model's input")


class BiasedAttention(nn.Module):
    """Self-attention that takes an additive bias from its caller (ALiBi: slopes times
    distance, -inf above the diagonal): finite values and -inf in one tensor, by design."""

    def __init__(self, d=32):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, bias):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias, -1) @ v)


class AlibiNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(16, 32), BiasedAttention(), nn.Linear(32, 1)

    def forward(self, x, bias):
        return self.head(self.attn(self.inp(x), bias))


def test_an_attention_bias_with_minus_inf_passed_in_is_not_blamed_for_an_overflow(tmp_path, verdict):
    db = tmp_path / "alibi.db"
    torch.manual_seed(0)
    model = AlibiNet()
    with torch.no_grad():
        model.inp.weight.mul_(1e5)  # the overflow: inp's output passes 65504
    distance = torch.arange(8.0)[None, :] - torch.arange(8.0)[:, None]
    bias = (-0.5 * distance.abs()).masked_fill(distance > 0, float("-inf"))

    def loss_of(step, model):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(torch.randn(4, 8, 16), bias).float().mean()

    train(db, model, 8, loss_of)
    code, rep = verdict(db)
    assert code == 1
    assert "input-nan" not in {f["rule"] for f in rep["findings"]}
    first = [f for f in rep["findings"] if f["rule"] == "forward-nonfinite"][0]
    assert first["module"] == "inp"


def test_a_loop_without_a_scalar_loss_still_names_the_layer_that_overflows_in_backward(tmp_path, verdict):
    # scale() is given the weighted output itself, backward() its gradient: no loss is
    # recorded, which is not a NaN loss. The gradient entering the last layer (50 x scale)
    # overflows its fp16 output; every forward stayed finite.
    db = tmp_path / "no_loss.db"
    torch.manual_seed(0)

    def output_of(step, model):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(torch.randn(64, 16)).float()

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    train(db, model, 12, output_of, gradient=lambda out: torch.full_like(out, 50.0), growth_interval=3)
    assert rows(db, "SELECT DISTINCT losses FROM steps") == [(0,)]
    code, rep = verdict(db)
    assert code == 1
    origin = [f for f in rep["findings"] if f["rule"] == "overflow-origin"]
    assert [(f["module"], f["layer"]) for f in origin] == [("4", "4.weight")]
    assert "forward-nonfinite" not in {f["rule"] for f in rep["findings"]}


class PaddedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = nn.Linear(16, 32), nn.MultiheadAttention(32, 4, batch_first=True), nn.Linear(32, 1)

    def forward(self, x, pad):
        h = self.emb(x)
        return self.head(self.attn(h, h, h, key_padding_mask=pad)[0].mean(1))


def test_an_empty_sequence_in_a_padding_mask_is_the_attentions_code_and_no_layer_is_pinned(tmp_path, verdict):
    # A batch with a sequence whose every key is padding: softmax over -inf only is NaN, in
    # any precision. The first step's overflow at init_scale only calibrated the scale.
    db = tmp_path / "empty_sequence.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        x, y = torch.randn(8, 10, 16), torch.randn(8, 1)
        pad = torch.zeros(8, 10, dtype=torch.bool)
        pad[:, 7:] = True
        if step % 7 == 3:
            pad[2, :] = True
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.functional.mse_loss(model(x, pad).float(), y)

    train(db, PaddedAttention(), 20, loss_of)
    code, rep = verdict(db)
    assert code == 1
    assert rules(rep, "error") == [("forward-nonfinite", "attn")]
    top = rep["findings"][0]
    assert "even in FP32" in top["title"] and "every entry is masked" in top["suggestions"][0]["summary"]
    assert all("pin_fp32" not in s["python"] for f in rep["findings"] for s in f["suggestions"])


def test_a_batch_whose_every_label_is_ignored_warns_about_the_nan_loss_and_fails_no_gate(tmp_path, verdict):
    # cross_entropy's mean over no label is 0/0 = NaN, with zero gradients: nothing skips,
    # nothing is lost, but the logged loss is NaN.
    db = tmp_path / "ignored.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        x, labels = torch.randn(16, 16), torch.randint(0, 8, (16,))
        if step % 8 == 5:
            labels[:] = -100
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        return nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)

    train(db, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), 16, loss_of, init_scale=1024)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    assert rules(rep, "warning") == [("forward-nonfinite", "")]
    assert "no update was lost" in rep["findings"][0]["evidence"]
    assert "ignore_index" in rep["findings"][0]["suggestions"][0]["summary"]
    assert rep["skipped_steps"] == []


def test_a_masked_mean_over_an_empty_mask_is_given_the_divisions_fix_not_ignore_index(tmp_path, verdict):
    # cross_entropy(reduction="none") cannot be 0/0; the loop's own sum / count over a batch
    # that keeps no sample is, and its NaN gradients skip those steps.
    db = tmp_path / "masked_mean.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        x, labels = torch.randn(16, 16), torch.randint(0, 8, (16,))
        keep = labels != 7 if step % 5 else torch.zeros(16, dtype=torch.bool)
        with torch.autocast("cpu", dtype=torch.float16):
            per_sample = nn.functional.cross_entropy(model(x), labels, reduction="none")
            return (per_sample * keep).sum() / keep.sum()

    train(db, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), 20, loss_of, init_scale=1024)
    code, rep = verdict(db)
    assert code == 1
    assert ("forward-nonfinite", "") in rules(rep, "error")
    found = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert "NllLoss(none)" in found["evidence"]
    assert "den.clamp_min(1e-12)" in found["suggestions"][0]["python"]
    assert not any("ignore_index=" in s["python"] for f in rep["findings"] for s in f["suggestions"])


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.full((16,), 1000.0))

    def forward(self, x):
        return x * self.gain.to(x.dtype)  # elementwise in fp16: Inf above 65504, never Inf - Inf


class ClampedProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.proj, self.head = nn.Linear(16, 16), Gain(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.clamp(self.proj(self.inp(x)), -100.0, 100.0))  # clamps proj's fp16 Inf away


def test_an_fp16_overflow_the_model_clamps_away_is_a_warning_and_fails_no_gate(tmp_path, verdict):
    db = tmp_path / "clamped.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        x = torch.randn(32, 16) * (100.0 if step % 4 == 2 else 1.0)  # proj's output overflows fp16 then
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x).float().pow(2).mean() * 1e-3

    train(db, ClampedProjection(), 12, loss_of, init_scale=256)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    forward = [f for f in rep["findings"] if f["rule"] == "forward-nonfinite"]
    assert [(f["module"], f["severity"], f["confirmation"]) for f in forward] == [("proj", "warning", "confirmed")]
    assert "absorbed" in forward[0]["evidence"]
    assert rep["skipped_steps"] == []


class SaturatedBlock(nn.Module):
    """One linear block applied four times, its output squashed by tanh: its fourth output
    overflows fp16 on every step, and tanh turns that Inf into 1, as it does in FP32."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1)
        with torch.no_grad():
            self.block.weight.mul_(40.0)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(4):
            h = self.block(h)
        return self.out(torch.tanh(h))


def test_an_overflow_absorbed_every_step_whose_only_skip_is_the_scales_calibration_fails_no_gate(tmp_path, verdict):
    # Step 0 skips at 65536, as the scaler finds its level, with the loss finite: not the
    # block's doing. It used to make the absorbed overflow an error.
    db = tmp_path / "saturated.db"
    torch.manual_seed(0)
    train(db, SaturatedBlock(), 20, random_regression(32))
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    assert [s["step"] for s in rep["skipped_steps"]] == [0]
    forward = [f for f in rep["findings"] if f["rule"] == "forward-nonfinite"]
    assert [(f["module"], f["severity"]) for f in forward] == [("block", "warning")]
    assert "the only ones skipped (1) were the loss scale's calibration" in forward[0]["evidence"]


def test_a_bf16_update_that_applied_a_nan_batchs_gradients_is_named_and_later_steps_blame_no_module(tmp_path, verdict):
    # No scaler skips the NaN batch's step: its NaN gradients go into the weights, and every
    # later forward is NaN "from finite inputs" (the replay says intrinsic: the weights are NaN).
    db = tmp_path / "bf16_nan_update.db"
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdiag.attach(model, optimizer=opt, db=db):
        for step in range(10):
            x = torch.randn(8, 16)
            if step == 4:
                x[0, 0] = float("nan")
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
    code, rep = verdict(db)
    assert code == 1
    assert sorted(rules(rep, "error")) == [("input-nan", ""), ("nonfinite-update", "")]
    update = next(f for f in rep["findings"] if f["rule"] == "nonfinite-update")
    assert update["steps"] == [4] and "5 of the 5 steps after it" in update["evidence"]
    assert "forward-nonfinite" not in {f["rule"] for f in rep["findings"]}  # no module's code blamed


def metric_learning(db, eps):
    """A contrastive loss on Euclidean distances written by hand: sqrt(|z_i - z_j|^2 + eps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))

    def loss_of(step, model):
        x, labels = torch.randn(16, 16), torch.randint(0, 4, (16,))
        with torch.autocast("cpu", dtype=torch.float16):
            z = model(x).float()
        d = (((z[:, None] - z[None]) ** 2).sum(-1) + eps).sqrt()
        same = labels[:, None] == labels[None]
        return (d * same).mean() + torch.relu(1 - d)[~same].mean()

    train(db, model, 12, loss_of)


def test_a_sqrt_of_zero_in_the_loss_is_named_as_the_losss_backward_not_a_layer_to_pin(tmp_path, verdict):
    # Each point's distance to itself is sqrt(0), whose gradient is infinite: NaN at every scale.
    db = tmp_path / "sqrt_zero.db"
    metric_learning(db, eps=0.0)
    code, rep = verdict(db)
    assert code == 1
    assert ("loss-backward", "") in rules(rep, "error")
    assert "overflow-origin" not in {f["rule"] for f in rep["findings"]}  # no layer to pin
    assert {k["forward_source"] for k in rep["skipped_steps"]} == {"loss-backward"}
    backward = next(f for f in rep["findings"] if f["rule"] == "loss-backward")
    assert ", Sqrt, " in backward["evidence"]  # the loss code, read from autograd's graph
    assert backward["suggestions"][0]["summary"].startswith("sqrt()'s gradient at 0 is infinite")


def test_the_epsilon_the_report_gives_trains_the_same_loop_healthy(tmp_path, verdict):
    db = tmp_path / "sqrt_eps.db"
    metric_learning(db, eps=1e-12)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)


def log_cosh_regression(db, stable):
    """A regression on targets up to 200 under a log-cosh loss, written as it reads or in its
    stable form: cosh() of a residual above 89.4 is Inf in float32."""
    torch.manual_seed(0)

    def loss_of(step, model):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(64, 16, generator=g), torch.rand(64, 1, generator=g) * 200
        with torch.autocast("cpu", dtype=torch.float16):
            d = model(x).float() - y
        if stable:
            return (d.abs() + nn.functional.softplus(-2 * d.abs()) - math.log(2)).mean()
        return torch.log(torch.cosh(d)).mean()

    train(db, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), 10, loss_of)


def test_a_log_cosh_loss_written_as_it_reads_is_given_its_stable_form_not_a_clamp_of_log(tmp_path, verdict):
    db = tmp_path / "logcosh.db"
    log_cosh_regression(db, stable=False)
    code, rep = verdict(db)
    assert code == 1
    top = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert "Sub, Cosh, Log, Mean (all float32)" in top["evidence"]
    assert top["suggestions"][0]["summary"].startswith("cosh() / sinh() overflow above 89.4 in float32")
    assert not any("log() of 0" in s["summary"] for s in top["suggestions"])


def test_the_stable_log_cosh_the_report_gives_trains_the_same_regression_healthy(tmp_path, verdict):
    db = tmp_path / "logcosh_stable.db"
    log_cosh_regression(db, stable=True)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)


class PairDistance(nn.Module):
    def forward(self, z):
        return ((z[:, None] - z[None]) ** 2).sum(-1).sqrt()  # sqrt(0) on the diagonal


class DistanceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dist, self.head = nn.Linear(16, 32), PairDistance(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.dist(self.enc(x).float()))


def test_a_nan_made_inside_the_models_backward_at_every_scale_points_to_that_backward_before_any_pin(
        tmp_path, verdict):
    # The NaN is made in dist's backward, between head's finite gradients and enc's; it goes
    # on while the scaler halves below 1, where no scale enlarges a gradient.
    db = tmp_path / "inner_sqrt.db"
    torch.manual_seed(0)
    train(db, DistanceNet(), 24, random_regression(16))
    code, rep = verdict(db)
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["module"] == "enc" and "at every loss scale" in origin["title"]
    assert origin["suggestions"][0]["summary"].startswith("Look first at the backward of dist, enc")


class Acoustic(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.proj = nn.Conv1d(20, 64, 3, padding=1), nn.Linear(64, 30)

    def forward(self, x):
        return self.proj(torch.relu(self.conv(x)).transpose(1, 2))


def speech(db, zero_infinity):
    """A CTC acoustic model, the loss in float32; every third batch holds a transcript
    longer than its audio, which no alignment fits: CTC's loss is Inf for it."""
    torch.manual_seed(0)
    ctc = nn.CTCLoss(blank=0, zero_infinity=zero_infinity)

    def loss_of(step, model):
        lengths = torch.randint(5, 20, (8,))
        if step % 3 == 0:
            lengths[0] = 60
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(torch.randn(8, 20, 50))
        logp = logits.float().log_softmax(-1).transpose(0, 1)
        return ctc(logp, torch.randint(1, 30, (int(lengths.sum()),)), torch.full((8,), 50), lengths)

    train(db, Acoustic(), 15, loss_of)


def test_an_infinite_ctc_loss_is_named_with_zero_infinity_and_not_with_an_fp32_loss(tmp_path, verdict):
    db = tmp_path / "ctc.db"
    speech(db, zero_infinity=False)
    code, rep = verdict(db)
    assert code == 1
    top = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert "CtcLoss" in top["evidence"] and "(all float32)" in top["evidence"]
    assert "zero_infinity=True" in top["suggestions"][0]["python"]
    assert not any(".float()" in s["python"] for s in top["suggestions"])  # it already is float32
    collapse = [f for f in rep["findings"] if f["rule"] == "scale-collapse"]
    assert all("the loss code after the model's last module" in f["suggestions"][0]["summary"] for f in collapse)


def test_zero_infinity_as_the_report_gives_it_trains_the_ctc_loop_healthy(tmp_path, verdict):
    db = tmp_path / "ctc_zero_infinity.db"
    speech(db, zero_infinity=True)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)


class ReturnsItsLoss(nn.Module):
    """Hugging Face style: forward(x, labels) returns {"logits", "loss"}, or, as Hugging
    Face's own outputs hold them, the loss first."""

    def __init__(self, loss_first):
        super().__init__()
        self.loss_first = loss_first
        self.body, self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Linear(32, 4)

    def forward(self, x, labels):
        logits = self.head(self.body(x))
        p = logits.float().softmax(-1) * torch.tensor([1.0, 1.0, 0.0, 1.0])  # class 2 weighted out
        loss = -p.gather(1, labels[:, None]).log().mean()  # log(0) for label 2
        return {"loss": loss, "logits": logits} if self.loss_first else {"logits": logits, "loss": loss}


@pytest.mark.parametrize("loss_first", [False, True], ids=["logits-first", "loss-first"])
def test_a_loss_the_model_computes_in_its_forward_has_its_code_read_between_the_logits_and_the_loss(
        tmp_path, verdict, loss_first):
    # Loss first: the model's NaN output is its loss, which is the loss code's, not code of
    # the model's own after its last module.
    db = tmp_path / "returns_loss.db"
    torch.manual_seed(0)

    def loss_of(step, model):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(torch.randn(8, 16), torch.randint(0, 4, (8,)))["loss"]

    train(db, ReturnsItsLoss(loss_first), 6, loss_of)
    code, rep = verdict(db)
    assert code == 1
    top = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert "ToCopy, Softmax, Mul, Gather, Log, Mean, Neg (all float32)" in top["evidence"]
    assert "clamp_min(1e-12).log()" in top["suggestions"][0]["python"]


def summed_regression(db, pin_head):
    """A regression summed over a batch of 2048 and 256 outputs (reduction="sum"): a loss around
    5e5, every layer's weight gradient a sum over the batch of about 2000."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256))
    if pin_head:
        ampdiag.pin_fp32(model[2])

    def loss_of(step, model):
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.functional.mse_loss(model(torch.randn(2048, 64)).float(), torch.randn(2048, 256), reduction="sum")

    train(db, model, 24, loss_of)


def test_a_loss_summed_over_the_batch_is_told_to_average_and_not_to_pin_its_last_layer(tmp_path, verdict):
    db = tmp_path / "run.db"
    summed_regression(db, pin_head=False)
    code, rep = verdict(db)
    assert code == 1
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["module"] == "2"
    assert "so pinning 2 alone would leave the scale below the floor" in origin["evidence"]
    fixes = [s["summary"] for s in origin["suggestions"]]
    assert "average over the batch instead of summing" in fixes[0]
    assert not any(s.startswith("Run 2 in FP32") for s in fixes), fixes


def test_the_last_layer_of_a_summed_loss_pinned_still_leaves_the_scale_below_the_floor(tmp_path, verdict):
    # What the pin that is no longer offered does: the overflow moves to the layer before it.
    db = tmp_path / "run.db"
    summed_regression(db, pin_head=True)
    code, rep = verdict(db)
    assert code == 1
    assert ("scale-collapse", "") in rules(rep, "error")
