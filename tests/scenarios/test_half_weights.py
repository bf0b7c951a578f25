"""Stalled weight updates in half-precision parameters: the agent's counts are what a direct
comparison of the weights before and after the optimizer step gives, on the sampled steps
only, and training is the same with and without it."""
import torch
from torch import nn

import ampdiag as agent
from conftest import rows


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).half()
    x, y = torch.randn(128, 32).half(), torch.randn(128, 1)
    return model, x, y


def train(steps, probe=None, **attach):
    """Pure fp16 SGD; `probe(step, model)` runs around each optimizer step (before, after)."""
    model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    handle = agent.attach(model, optimizer=opt, **attach) if attach else None
    for step in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x).float(), y).backward()
        before = probe(step, model) if probe else None
        opt.step()
        if probe:
            probe(step, model, before)
    if handle:
        handle.close()
    return model


class DirectCounts:
    """Per step and layer: (step, layer, elements with a finite non-zero gradient, of those
    the ones whose value did not change), compared directly."""

    def __init__(self):
        self.rows = []

    def __call__(self, step, model, before=None):
        if before is None:
            return [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
        for layer, (p, (old, grad)) in enumerate(zip(model.parameters(), before)):
            moved = torch.isfinite(grad) & (grad != 0)
            self.rows.append((step, layer, int(moved.sum()), int((moved & (p.detach() == old)).sum())))


def test_stalled_counts_equal_a_direct_comparison_on_sampled_steps(tmp_path):
    db = tmp_path / "half.db"
    watched = train(9, db=db, every=4)
    direct = DirectCounts()
    plain = train(9, probe=direct)
    for a, b in zip(watched.parameters(), plain.parameters()):
        assert torch.equal(a, b)  # the probe changes nothing the training computes
    recorded = rows(db, "SELECT step, layer_id, nonzero, stalled FROM weight_updates ORDER BY step, layer_id")
    assert recorded == [r for r in direct.rows if r[0] % 4 == 0]
    assert any(stalled > nonzero // 2 for _, _, nonzero, stalled in recorded)  # the case is a real one


def test_an_fp16_model_without_a_scaler_is_recorded_as_float16(tmp_path):
    db = tmp_path / "half.db"
    train(1, db=db)
    assert rows(db, "SELECT value FROM meta WHERE key = 'amp_dtype'") == [("float16",)]


def test_bf16_parameters_under_a_grad_scaler_are_measured_only_on_steps_the_optimizer_took(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(16, 4).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    with agent.attach(model, scaler, db=tmp_path / "bf16.db") as handle:
        skipped = []
        for step in range(4):
            opt.zero_grad()
            gain = 1e38 if step == 1 else 1.0  # step 1's scaled gradients overflow: the scaler skips it
            scaler.scale(model(x).float().sum() * gain).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(handle.last_step_skipped)
    assert skipped == [False, True, False, False]
    assert sorted({s for (s,) in rows(tmp_path / "bf16.db", "SELECT step FROM weight_updates")}) == [0, 2, 3]


def test_fp32_parameters_get_no_update_rows(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with agent.attach(model, optimizer=opt, db=tmp_path / "fp32.db"):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
    assert rows(tmp_path / "fp32.db", "SELECT count(*) FROM weight_updates") == [(0,)]
