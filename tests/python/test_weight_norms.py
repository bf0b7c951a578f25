"""The weight sampler: each parameter's L2 norm and abs-max on the session core's schedule
(tests/agent_core/test_policy.cpp: the start of steps 0, 1, 2, 3, 4, 6, 8, 12, ... and the end
of the first skipped steps), as the step's forward used them; the optimizer's settings once,
and again where a learning-rate schedule moved the rate 2x or more."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def train(db, steps, overflow_at=(), schedule=None):
    """SGD steps of a small fp16-autocast model with a real GradScaler; a step in
    `overflow_at` has an Inf loss (skipped); `schedule(optimizer)` makes an LR scheduler
    stepped after each step. Returns {step: {name: (l2, absmax)}} of the weights each step's
    forward used."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = schedule(opt) if schedule else None
    scaler = torch.amp.GradScaler("cpu")
    seen = {}
    with ampdiag.attach(model, scaler, db=str(db)):
        for step in range(steps):
            seen[step] = {n: (float(p.detach().norm()), float(p.detach().abs().max())) for n, p in model.named_parameters()}
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean() * (float("inf") if step in overflow_at else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if scheduler is not None:
                scheduler.step()
    return seen


def test_each_sampled_step_has_the_norms_its_forward_used(tmp_path):
    seen = train(tmp_path / "run.db", 10)
    recorded = rows(tmp_path / "run.db", "SELECT w.step, l.name, w.l2, w.absmax FROM weight_norms w "
                                         "JOIN layers l ON l.id = w.layer_id ORDER BY w.step, l.id")
    assert sorted({step for step, *_ in recorded}) == [0, 1, 2, 3, 4, 6, 8]
    for step, name, l2, absmax in recorded:
        want_l2, want_max = seen[step][name]
        assert abs(l2 - want_l2) <= 1e-5 * want_l2 and absmax == want_max


@pytest.fixture()
def weights_as_if_on_a_device(monkeypatch, device_copies_on_the_host):
    """The sampler's device path on host tensors: each parameter taken as a device one."""
    from ampdiag import _weights

    def as_device(self, layer, p):
        if p.is_floating_point():
            self._device_params.setdefault(p.device, []).append((layer, p))

    monkeypatch.setattr(_weights.WeightSampler, "add", as_device)


def test_device_weights_read_back_later_are_recorded_at_the_step_they_were_read_at(tmp_path,
                                                                                  weights_as_if_on_a_device):
    seen = train(tmp_path / "run.db", 10)
    recorded = rows(tmp_path / "run.db", "SELECT w.step, l.name, w.l2, w.absmax FROM weight_norms w "
                                         "JOIN layers l ON l.id = w.layer_id ORDER BY w.step, l.id")
    assert sorted({step for step, *_ in recorded}) == [0, 1, 2, 3, 4, 6, 8]  # step 8's landed at close()
    for step, name, l2, absmax in recorded:
        want_l2, want_max = seen[step][name]
        assert abs(l2 - want_l2) <= 1e-5 * want_l2 and absmax == want_max


def test_skipped_steps_are_sampled_off_the_schedule(tmp_path):
    train(tmp_path / "run.db", 16, overflow_at=(11, 13))
    assert {s for (s,) in rows(tmp_path / "run.db", "SELECT DISTINCT step FROM weight_norms")} >= {11, 13}
    assert rows(tmp_path / "run.db", "SELECT step FROM steps WHERE skipped = 1") == [(11,), (13,)]


def test_the_optimizers_settings_are_recorded_once(tmp_path):
    train(tmp_path / "run.db", 5)
    assert rows(tmp_path / "run.db", "SELECT detail FROM events WHERE kind = 'optimizer-settings'") == [
        ("SGD lr=0.05 weight_decay=0 momentum=0.9",)]


def test_a_schedule_that_moves_the_rate_twofold_has_it_recorded_again_on_a_sampled_step(tmp_path):
    # x4 after step 4 (step 5 on): looked at on the schedule's next sampled step, 6.
    train(tmp_path / "run.db", 10, schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 4.0 if s >= 5 else 1.0))
    assert rows(tmp_path / "run.db", "SELECT step, detail FROM events WHERE kind = 'optimizer-settings'") == [
        (0, "SGD lr=0.05 weight_decay=0 momentum=0.9"), (6, "SGD lr=0.2 weight_decay=0 momentum=0.9")]


def test_a_rate_moved_less_than_twofold_is_not_recorded_again(tmp_path):
    train(tmp_path / "run.db", 10, schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.5 if s >= 5 else 1.0))
    assert len(rows(tmp_path / "run.db", "SELECT step FROM events WHERE kind = 'optimizer-settings'")) == 1


def test_a_warm_up_from_zero_has_its_rate_recorded_once_it_rises(tmp_path):
    train(tmp_path / "run.db", 5, schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: s / 4))
    said = rows(tmp_path / "run.db", "SELECT step, detail FROM events WHERE kind = 'optimizer-settings'")
    assert said[0] == (0, "SGD lr=0 weight_decay=0 momentum=0.9") and said[1][0] == 1 and "lr=0.0125 " in said[1][1]


def sampled_at_start(db, model):
    """{layer name: (l2, absmax)} the weight sampler recorded at step 0 of a one-step run."""
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD([p for p in model.parameters() if p.dtype != torch.float64], lr=0.01)
    with ampdiag.attach(model, scaler, db=str(db)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model[0](torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return {name: (l2, absmax) for name, l2, absmax in rows(db, "SELECT l.name, w.l2, w.absmax FROM weight_norms w "
                                                             "JOIN layers l ON l.id = w.layer_id WHERE w.step = 0")}


def test_a_weight_holding_nan_has_no_norm_row_and_the_others_have_theirs(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    weight = model[0].weight.detach().clone()  # as step 0's forward uses it
    recorded = sampled_at_start(tmp_path / "run.db", model)
    assert set(recorded) == {"0.weight", "0.bias", "1.bias"}
    assert recorded["0.weight"] == (pytest.approx(float(weight.norm()), rel=1e-6), float(weight.abs().max()))


def test_float16_and_float64_weights_have_their_norms_read_without_overflowing_their_range(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    model.register_parameter("halves", nn.Parameter(torch.full((64,), 60000.0, dtype=torch.float16)))
    model.register_parameter("wide", nn.Parameter(torch.full((16,), 1e100, dtype=torch.float64)))  # beyond float32
    recorded = sampled_at_start(tmp_path / "run.db", model)
    assert recorded["halves"] == (pytest.approx(60000.0 * 8, rel=1e-9), 60000.0)  # its squares pass fp16's range
    assert recorded["wide"] == (pytest.approx(1e100 * 4, rel=1e-9), pytest.approx(1e100, rel=1e-9))


def test_an_empty_float64_weight_has_zero_norms_and_the_training_goes_on(tmp_path):
    # torch's foreach infinity norm has no value for an empty tensor: it raises.
    model = nn.Sequential(nn.Linear(8, 4))
    model.register_parameter("none", nn.Parameter(torch.empty(0, dtype=torch.float64)))
    assert sampled_at_start(tmp_path / "run.db", model)["none"] == (0.0, 0.0)


def test_an_empty_device_weight_has_zero_norms_beside_the_others(tmp_path, weights_as_if_on_a_device):
    model = nn.Sequential(nn.Linear(8, 4))
    model.register_parameter("none", nn.Parameter(torch.empty(0)))
    recorded = sampled_at_start(tmp_path / "run.db", model)
    assert recorded["none"] == (0.0, 0.0) and set(recorded) == {"0.weight", "0.bias", "none"}
