"""Event "chained-calls": a module the forward runs again and again, each call taking the
last one's output (ALBERT's shared layer, a cell in a loop over time steps), is recorded
once; two calls of one module on inputs of their own (a contrastive loss's two views) are
not. overflow-origin reads it: the first NaN/Inf gradient among such a block's shared
parameters does not say which call made it."""
import sqlite3

import torch
from torch import nn

import ampdiag
from conftest import train


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.ffn(x))


class Shared(nn.Module):
    """One block run three times, each on the last one's output."""

    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(16, 1)

    def forward(self, x):
        for _ in range(3):
            x = self.block(x)
        return self.head(x)


class TwoViews(nn.Module):
    """One encoder on two inputs of its own: a contrastive loss's views."""

    def __init__(self):
        super().__init__()
        self.encoder, self.head = Block(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.encoder(x) - self.encoder(x.flip(0)))


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.rec = nn.Linear(4, 16), nn.Linear(16, 16)

    def forward(self, x, h):
        return torch.tanh(self.inp(x) + self.rec(h))


class Loop(nn.Module):
    """A cell called once per time step, its state the second argument."""

    def __init__(self):
        super().__init__()
        self.cell, self.head = Cell(), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 16)
        for t in range(4):
            h = self.cell(x[:, 4 * t:4 * t + 4], h)
        return self.head(h)


def chained(tmp_path, model_factory):
    db = tmp_path / "run.db"
    train(3, lambda model, scaler, _: ampdiag.attach(model, scaler, db=db), model_factory=model_factory)
    with sqlite3.connect(db) as c:
        return c.execute("SELECT detail FROM events WHERE kind = 'chained-calls' ORDER BY detail").fetchall()


def test_a_block_run_on_its_own_output_is_recorded_once(tmp_path):
    assert chained(tmp_path, Shared) == [("block",)]


def test_a_cell_given_its_last_output_as_its_state_is_recorded(tmp_path):
    assert chained(tmp_path, Loop) == [("cell",)]


def test_an_encoder_run_on_two_inputs_of_its_own_is_not_recorded(tmp_path):
    assert chained(tmp_path, TwoViews) == []
