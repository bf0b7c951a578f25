"""Event "fp32-gradients": the parameters whose every backward part autocast computed in FP32
(an exp() of a float32 parameter, an RMSNorm weight multiplying float32 values, a float32
embedding table), read once from the first scaled loss's graph; not a weight autocast casts
to fp16 (a Linear's, or one transposed before the cast), nor a LayerNorm's, whose backward
receives its fp16 output's gradient."""
import sqlite3

import torch
from torch import nn

import ampdiag
from ampdiag import _ampdiag
from ampdiag._fp32_gradients import gradient_graph


class Mixer(nn.Module):
    """A Mamba-like block: A_log enters through exp() of its float32 value; proj is transposed
    before the matmul that autocast casts it for (its part: TBackward0 under ToCopyBackward0)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.ln, self.rms = nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.RMSNorm(8)
        self.A_log = nn.Parameter(torch.zeros(8))
        self.proj = nn.Parameter(torch.eye(8))
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        h = self.rms(self.ln(self.lin(self.emb(ids)))) @ self.proj.t()
        return self.head(h * torch.exp(self.A_log.float()))


def fp32_events(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT step, detail FROM events WHERE kind = 'fp32-gradients'").fetchall()


def train(db, steps=3):
    torch.manual_seed(0)
    model = Mixer()
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, optimizer=opt, db=db):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randint(0, 10, (2, 5))).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_the_parameters_whose_gradients_autocast_computes_in_fp32_are_named_once(tmp_path):
    db = tmp_path / "run.db"
    train(db)
    assert fp32_events(db) == [(0, "A_log, emb.weight, rms.weight")]


class Scaled(torch.autograd.Function):
    """x * w in fp16, handed back in float32: its backward's precision is its own code's."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (x.half() * w.half()).float()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g.half() * w.half()).float(), (g.half() * x.half()).sum(0).float()


def test_a_part_from_a_custom_functions_backward_is_not_taken_as_fp32():
    w = nn.Parameter(torch.ones(3))
    loss = Scaled.apply(torch.ones(2, 3), w).exp().sum()
    ops, received, edges, parts = gradient_graph([loss.grad_fn], {id(w): "w"})
    assert parts == [(ops.index(""), "w")]
    assert _ampdiag.fp32_gradients(ops, received, edges, parts) == ""


def test_a_graph_larger_than_the_walk_is_not_read(monkeypatch):
    # A parameter with a part outside the walk could have an fp16 one.
    monkeypatch.setattr(_ampdiag, "FP32_WALK_NODES", 3)
    model = Mixer()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randint(0, 10, (2, 5))).float().mean()
    assert gradient_graph([loss.grad_fn], {id(p): name for name, p in model.named_parameters()}) is None
