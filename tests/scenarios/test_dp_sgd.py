"""DP-SGD as Opacus trains it, under fp16 autocast and the GradScaler of the AMP recipe. Opacus
keeps each sample's gradient in `p.grad_sample` (of the per-sample loss, computed in the dtype
the backward ran in), and its DPOptimizer (a torch Optimizer subclass that never ran torch's
__init__, holding the real one as `.original_optimizer`) clips, sums and noises them into
.grad inside step(), after the scaler has unscaled and checked .grad. The scaler never sees
them: at 65536 a head's per-sample gradients overflow float16 while .grad stays finite, the
scaler applies the step, and the update is NaN. attach() had refused the DPOptimizer; given
the optimizer inside it, the report said only that the optimizer made NaN from finite
gradients. The loop here is Opacus's in miniature (hooks for per-sample gradients of Linear
layers, the DPOptimizer's clip, sum and noise), since Opacus is no dependency of ours."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdiag
from conftest import rows

# The first Linear's full backward hook fires on its output's gradient alone (its input needs none).
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


def keep_per_sample_gradients(model, batch):
    """Per-sample gradients of every Linear in `model`, as Opacus's GradSampleModule makes them:
    the output's gradient times the batch size (a mean loss), times the input, in the dtype
    of the backward."""
    def keep_input(module, args, output):
        module.activations = args[0].detach()

    def per_sample(module, grad_input, grad_output):
        backprops = grad_output[0] * batch
        activations = module.activations.to(backprops.dtype)
        module.weight.grad_sample = torch.einsum("ni,nj->nij", backprops, activations)
        module.bias.grad_sample = backprops

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(keep_input)
            m.register_full_backward_hook(per_sample)


class DPOptimizer(torch.optim.Optimizer):
    """Opacus's DPOptimizer in short: clip each sample's gradient to max_grad_norm, sum, add
    Gaussian noise, average, then step the optimizer it holds."""

    def __init__(self, optimizer, noise_multiplier, max_grad_norm, batch):
        self.original_optimizer = optimizer
        self.noise_multiplier, self.max_grad_norm, self.batch = noise_multiplier, max_grad_norm, batch
        self.generator = torch.Generator().manual_seed(1)

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @property
    def state(self):
        return self.original_optimizer.state

    @property
    def params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad_sample = None
        self.original_optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        norms = torch.stack([p.grad_sample.reshape(self.batch, -1).norm(2, dim=-1) for p in self.params], 1)
        clip = (self.max_grad_norm / (norms.norm(2, dim=1) + 1e-6)).clamp(max=1.0)
        for p in self.params:
            summed = torch.einsum("i,i...", clip.to(p.dtype), p.grad_sample.to(p.dtype))
            noise = torch.normal(0.0, self.noise_multiplier * self.max_grad_norm, p.shape, generator=self.generator)
            p.grad = (summed + noise) / self.batch
        return self.original_optimizer.step(closure)


def train_dp(db, dtype=torch.float16, scaler=True, init_scale=65536.0, steps=8, batch=32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    keep_per_sample_gradients(model, batch)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                      batch=batch)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=scaler)
    g = torch.Generator().manual_seed(0)
    with ampdiag.attach(model, grad_scaler if scaler else None, opt, db=db):
        for _ in range(steps):
            x, y = torch.randn(batch, 16, generator=g) * 3, torch.randint(0, 10, (batch,), generator=g)
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(model(x).float(), y)
            if scaler:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
    return model


def test_dp_sgd_whose_per_sample_gradients_overflow_under_the_scaler_is_told_to_drop_it(tmp_path, verdict):
    db = tmp_path / "run.db"
    model = train_dp(db)
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the update the scaler applied was NaN
    code, rep = verdict(db)
    assert code == 1
    per_sample = next(f for f in rep["findings"] if f["rule"] == "per-sample-gradients")
    assert per_sample["severity"] == "error"
    assert ("at step 0 the per-sample gradients of 0.weight (+1 more) held NaN/Inf while .grad was finite, so the "
            "scaler applied the step") in per_sample["evidence"]
    assert per_sample["suggestions"][0]["summary"].startswith("Train the DP-SGD loop without a GradScaler, under "
                                                               "bfloat16 autocast")
    update = next(f for f in rep["findings"] if f["rule"] == "nonfinite-update")
    assert update["suggestions"][0]["summary"] == per_sample["suggestions"][0]["summary"]


def test_the_agent_watches_the_optimizer_inside_a_dp_optimizer(tmp_path):
    db = tmp_path / "run.db"
    train_dp(db, init_scale=16.0, steps=3)
    assert rows(db, "SELECT count(*) FROM steps") == [(3,)]
    [(detail,)] = rows(db, "SELECT detail FROM events WHERE kind = 'per-sample-gradients'")
    assert detail.startswith("4 of the optimizer's parameters carry per-sample gradients (grad_sample, float16,")


def test_dp_sgd_under_a_scaler_that_overflows_nothing_is_warned_of_its_scaled_clipping(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_dp(db, init_scale=16.0)
    code, rep = verdict(db)
    assert code == 0
    [per_sample] = [f for f in rep["findings"] if f["rule"] == "per-sample-gradients"]
    assert per_sample["severity"] == "warning"
    assert "its max_grad_norm bounds them times the scale, not the gradients it was chosen for" in per_sample["evidence"]


def test_dp_sgd_in_bfloat16_without_a_scaler_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    train_dp(db, dtype=torch.bfloat16, scaler=False)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    assert rep["findings"] == []
