"""`ampdiag whatif` against the real torch.amp.GradScaler: the vit_overflow sample's model
trained under one scaler configuration with ampdiag attached, then trained again, without
it, under others; the prediction for each must match what the real scaler did (skipped
steps within one)."""
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ampdiag as agent

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "samples" / "python"))
import vit_overflow as vit  # noqa: E402

STEPS = 60


def train(init_scale, growth_interval, backoff_factor=0.5, db=None, histogram=False):
    """The sample's loop; returns (skipped steps, lowest scale)."""
    torch.manual_seed(0)
    model = vit.Vit()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval,
                                  backoff_factor=backoff_factor)
    x, y = torch.randn(vit.BATCH, vit.TOKENS, vit.DIM), torch.randn(vit.BATCH, 1)
    handle = agent.attach(model, scaler, db=db, histogram=histogram) if db else None
    result = fp16_steps(model, optimizer, scaler, x, y, STEPS)
    if handle:
        handle.close()
    return result


def fp16_steps(model, optimizer, scaler, x, y, steps):
    """An MSE regression loop under fp16 autocast; returns (skipped steps, lowest scale)."""
    skipped, lowest = 0, scaler.get_scale()
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
        lowest = min(lowest, scaler.get_scale())
    return skipped, lowest


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    db = tmp_path_factory.mktemp("whatif") / "a.db"
    train(65536.0, 10, db=db)
    return db


@pytest.mark.parametrize("init_scale, growth_interval, backoff_factor",
                         [(1024.0, 10, 0.5), (256.0, 5, 0.5), (1024.0, 100, 0.25), (8192.0, 2000, 0.5)])
def test_the_prediction_matches_a_rerun_under_that_configuration(recorded, ampdiag, init_scale, growth_interval,
                                                                 backoff_factor):
    result = ampdiag("whatif", recorded, "--init-scale", init_scale, "--growth-interval", growth_interval,
                     "--backoff-factor", backoff_factor, "--format", "json")
    assert result.returncode == 0, result.stderr
    predicted = json.loads(result.stdout)["predictions"][0]
    skipped, lowest = train(init_scale, growth_interval, backoff_factor)
    assert abs(predicted["estimate"]["skipped"] - skipped) <= 1, (predicted, skipped)
    assert predicted["estimate"]["lowest_scale"] == lowest


def test_the_search_recommends_fewer_skips_than_the_recorded_configuration_and_a_rerun_agrees(recorded, ampdiag):
    result = ampdiag("whatif", recorded, "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    best = report["predictions"][0]
    assert best["estimate"]["skipped"] < report["recorded"]["skipped"]
    c = best["config"]
    skipped, _ = train(c["init_scale"], c["growth_interval"], c["backoff_factor"])
    assert abs(best["estimate"]["skipped"] - skipped) <= 1
    text = ampdiag("whatif", recorded).stdout
    assert "Recommended: torch.amp.GradScaler(" in text


def test_bad_options_are_refused_with_the_option_named(recorded, ampdiag):
    result = ampdiag("whatif", recorded, "--growth-interval", "0")
    assert result.returncode == 2
    assert "--growth-interval" in result.stderr


def test_a_bf16_run_without_a_scaler_is_refused(tmp_path, ampdiag):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    db = tmp_path / "bf16.db"
    with agent.attach(model, optimizer=optimizer, db=db):
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
    result = ampdiag("whatif", db)
    assert result.returncode == 2
    assert "without a loss scaler" in result.stderr


def test_with_histograms_a_far_lower_scale_predicts_more_values_flushed_to_zero(tmp_path, ampdiag):
    db = tmp_path / "hist.db"
    train(65536.0, 10, db=db, histogram=True)

    def share(init_scale):
        result = ampdiag("whatif", db, "--init-scale", init_scale, "--format", "json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["predictions"][0]["underflow_share"]

    low, high = share(2.0 ** -20), share(64.0)
    assert 0.0 <= high < low <= 1.0
    assert "flushed to zero in fp16:" in ampdiag("whatif", db, "--init-scale", 2.0 ** -20).stdout


def test_a_healthy_run_whose_only_skips_are_the_scale_coming_down_is_told_to_keep_its_scaler(tmp_path, ampdiag):
    # torch's default init_scale 65536 is too high for these gradients: the first steps skip
    # while the scale comes down, then none do. A lower init_scale saves only those, once.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "healthy.db"
    x, y = torch.randn(64, 32) * 4, torch.randn(64, 1) * 4
    with agent.attach(model, scaler, db=db):
        fp16_steps(model, optimizer, scaler, x, y, 40)
    result = ampdiag("whatif", db, "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["recorded"]["skipped"] > 0
    best = report["predictions"][0]["estimate"]
    assert best["calibration_skipped"] == best["skipped"]
    assert report["improves_on_recorded"] is False
    assert "keep the recorded configuration" in ampdiag("whatif", db).stdout
