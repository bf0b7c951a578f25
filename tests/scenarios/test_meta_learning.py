"""MAML on sine regression under fp16 autocast with torch's GradScaler: each task adapts the
weights with torch.autograd.grad(create_graph=True) and torch.func.functional_call, and the
meta-loss's backward differentiates through that inner step. Its backward then also runs the
modules' backward in reverse, which at a scale of 65536 overflows fp16 and reaches the inner
call's output: the scaler's calibration, which the report had named as NaN made by the loss
code's backward (an error). And where the first layers start far too large, the adapted
weights functional_call swaps in for the call went NaN with the overflow, which the report had
taken for NaN written into the stored parameters outside the optimizer."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.func import functional_call

import ampdiag
from conftest import rows, rules


def maml(db, gain=1.0, steps=30):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[2].weight.mul_(gain)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)

    def task():
        amplitude, phase = torch.rand(1, generator=g) * 4.9 + 0.1, torch.rand(1, generator=g) * 3.14
        support, query = torch.rand(10, 1, generator=g) * 10 - 5, torch.rand(10, 1, generator=g) * 10 - 5
        return support, amplitude * torch.sin(support + phase), query, amplitude * torch.sin(query + phase)

    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            meta = 0.0
            for _ in range(4):
                xs, ys, xq, yq = task()
                params = dict(model.named_parameters())
                with torch.autocast("cpu", dtype=torch.float16):
                    inner = F.mse_loss(functional_call(model, params, (xs,)), ys)
                grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
                adapted = {name: p - 0.01 * grad for (name, p), grad in zip(params.items(), grads)}
                with torch.autocast("cpu", dtype=torch.float16):
                    meta = meta + F.mse_loss(functional_call(model, adapted, (xq,)), yq) / 4
            scaler.scale(meta).backward()
            scaler.step(opt)
            scaler.update()


def test_maml_whose_meta_backward_overflows_at_the_initial_scale_is_healthy(tmp_path, verdict):
    db = tmp_path / "maml.db"
    maml(db)
    assert rows(db, "SELECT count(*) FROM steps WHERE skipped = 1")[0][0] >= 1  # the calibration
    assert rows(db, "SELECT count(*) FROM events WHERE kind = 'gradients-differentiated'")[0][0] == 1
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)
    assert "loss-backward" not in [rule for rule, _ in rules(rep)]


def test_maml_with_oversized_weights_names_the_overflow_and_not_the_stored_parameters(tmp_path, verdict):
    db = tmp_path / "maml.db"
    maml(db, gain=300.0, steps=12)
    code, rep = verdict(db)
    assert code == 1
    found = rules(rep)
    assert ("forward-nonfinite", "4") in found and ("oversized-weights", "2") in found
    assert "nonfinite-parameters" not in [rule for rule, _ in found]
