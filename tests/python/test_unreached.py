"""Event "parameters-unreached": the parameters an optimizer holds whose gradient never
arrived, written after 20 reads of the gradients or at close(); none for a parameter no
optimizer holds (a frozen backbone left out of the optimizer), nor once every one arrived."""
import sqlite3
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampdiag


class Blocks(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(50, 16)
        self.emb.weight.requires_grad_(False)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(checkpoint(self.block, self.emb(ids), use_reentrant=self.reentrant).mean(1))


def unreached_events(db, params_of, steps, reentrant=True):
    torch.manual_seed(0)
    model = Blocks(reentrant)
    opt = torch.optim.SGD(params_of(model), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings(), ampdiag.attach(model, scaler, opt, db=db):
        warnings.simplefilter("ignore")  # torch's: "None of the inputs have requires_grad=True"
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(torch.randint(0, 50, (4, 6))), torch.randint(0, 3, (4,)))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    with sqlite3.connect(db) as c:
        return c.execute("SELECT step, detail FROM events WHERE kind = 'parameters-unreached'").fetchall()


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_parameters_the_optimizer_holds_without_a_gradient_are_written_after_20_reads(tmp_path):
    assert unreached_events(tmp_path / "run.db", trainable, 25) == [
        (19, "272 of 323 values, 2 of 4 parameters the optimizers hold: block.weight, block.bias")]


def test_a_shorter_run_writes_them_at_close(tmp_path):
    [(_, detail)] = unreached_events(tmp_path / "run.db", trainable, 6)
    assert detail.startswith("272 of 323 values, 2 of 4 parameters")


def test_parameters_no_optimizer_holds_are_not_written(tmp_path):
    assert unreached_events(tmp_path / "run.db", lambda model: model.head.parameters(), 25) == []


def test_nothing_is_written_once_every_gradient_arrived(tmp_path):
    assert unreached_events(tmp_path / "run.db", trainable, 25, reentrant=False) == []
