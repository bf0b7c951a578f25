"""Where the loss's backward made the NaN that reached the model's output (event
"output-gradient-nonfinite"), the first operation of the loss code whose backward sent
NaN/Inf back from finite gradients, traced at a later step: event "loss-code-origin", the
operations from the model's output to it, it last. A batch-hard triplet loss on normalised
embeddings takes sqrt() of each embedding's squared distance to itself, 0, after
F.normalize's division: the sqrt is the origin, not the division."""
import sqlite3

import torch
from torch import nn

import ampdiag


def events(db, kind):
    with sqlite3.connect(db) as c:
        return [d for (d,) in c.execute("SELECT detail FROM events WHERE kind = ? ORDER BY step", (kind,))]


def distances(e):
    e = nn.functional.normalize(e, dim=-1)
    return (e[:, None] - e[None]).pow(2).sum(-1).sqrt()


def train(db, loss_of, steps=4):
    torch.manual_seed(0)
    model = nn.Linear(12, 8)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model(torch.randn(16, 12)))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_the_origin_of_a_distance_to_itself_is_its_sqrt_after_the_normalisation(tmp_path):
    db = tmp_path / "run.db"
    train(db, lambda e: distances(e).mean())
    assert events(db, "output-gradient-nonfinite")
    [origin] = events(db, "loss-code-origin")
    assert origin.startswith("LinalgVectorNorm:float16"), origin
    assert origin.endswith(", Sqrt:float16"), origin


def test_a_loss_whose_backward_stays_finite_has_no_origin_traced(tmp_path):
    db = tmp_path / "run.db"
    train(db, lambda e: e.pow(2).mean())
    assert events(db, "loss-code-origin") == []
