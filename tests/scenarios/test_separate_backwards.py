"""Losses given a backward each in one step (a main loss and an auxiliary one, with
retain_graph): a layer the second backward reaches again is ordered by that arrival, so a
NaN/Inf the second loss makes is first in its own head, not in the shared trunk whose
first gradient came earlier."""
import torch
import torch.nn.functional as F
from torch import nn

import ampdiag
from conftest import rows


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU())
        self.cls = nn.Linear(128, 10)
        self.aux = nn.Linear(128, 4)

    def forward(self, x):
        h = self.body(x)
        return self.cls(h), self.aux(h)


def two_backward_loop(db, steps=6, aux_log_of_zero=False):
    """The main loss's backward, then the auxiliary loss's; with `aux_log_of_zero`, the
    auxiliary loss takes log() of fp16 softmax probabilities that round to 0 (-inf)."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=str(db)):
        for _ in range(steps):
            x, y, ya = torch.randn(64, 32), torch.randint(0, 10, (64,)), torch.randint(0, 4, (64,))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits, aux = model(x)
                main = F.cross_entropy(logits, y)
                if aux_log_of_zero:
                    aux_loss = -torch.softmax(aux * 30, -1).gather(1, ya[:, None]).log().mean()
                else:
                    aux_loss = F.cross_entropy(aux, ya)
            scaler.scale(main).backward(retain_graph=True)
            scaler.scale(0.3 * aux_loss).backward()
            scaler.step(opt)
            scaler.update()


def test_the_second_losss_nan_is_first_in_its_own_head_not_in_the_shared_trunk(tmp_path, verdict):
    db = tmp_path / "aux.db"
    two_backward_loop(db, aux_log_of_zero=True)
    code, rep = verdict(db)
    assert code == 1
    skipped = rep["skipped_steps"]
    assert skipped and all(s["nonfinite_layers"][0] == "aux.weight" for s in skipped), skipped
    # the trunk's gradients were last reached by the auxiliary backward, after its head's
    order = dict(rows(db, "SELECT l.name, g.bwd_order FROM grad_stats g JOIN layers l ON l.id = g.layer_id "
                          "WHERE g.step = 0"))
    assert order["cls.weight"] < order["aux.weight"] < order["body.0.weight"]


def test_two_healthy_backwards_a_step_are_healthy(tmp_path, verdict):
    db = tmp_path / "aux.db"
    two_backward_loop(db)
    assert verdict(db)[0] == 0


def test_per_task_gradients_taken_with_autograd_grad_order_the_trunk_after_the_last_tasks_head(tmp_path):
    # Gradient surgery: each task's gradients through torch.autograd.grad, combined into .grad
    # by hand; the auxiliary task's call reaches its head, then the trunk again.
    db = tmp_path / "surgery.db"
    torch.manual_seed(0)
    model = TwoHeads()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=str(db)):
        for _ in range(2):
            x, y, ya = torch.randn(64, 32), torch.randint(0, 10, (64,)), torch.randint(0, 4, (64,))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits, aux = model(x)
                main, aux_loss = F.cross_entropy(logits, y), F.cross_entropy(aux, ya)
            g_main = torch.autograd.grad(scaler.scale(main), params, retain_graph=True, allow_unused=True)
            g_aux = torch.autograd.grad(scaler.scale(aux_loss), params, allow_unused=True)
            for p, a, b in zip(params, g_main, g_aux):
                p.grad = sum(g for g in (a, b) if g is not None)
            scaler.step(opt)
            scaler.update()
    order = dict(rows(db, "SELECT l.name, g.bwd_order FROM grad_stats g JOIN layers l ON l.id = g.layer_id "
                          "WHERE g.step = 1"))
    assert order["cls.weight"] < order["aux.weight"] < order["body.0.weight"]
