"""Event "module-input-from": a module whose first argument is the last hooked module's
output, unchanged or a view of it, is recorded as given it, once; overflow-origin reads it
to name the module whose backward sends an overflowed gradient into the one before it."""
import sqlite3

import torch
from torch import nn

import ampdiag
from conftest import train


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(8, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.b(self.a(x))  # a's output as it is
        h = self.c(h.view(-1, 2, 8)[:, 0])  # a view of b's output
        return self.d(h.relu())  # after a relu: a new tensor


def test_modules_given_the_last_output_or_a_view_of_it_are_recorded_once(tmp_path):
    db = tmp_path / "run.db"
    train(3, lambda model, scaler, _: ampdiag.attach(model, scaler, db=db), model_factory=Chain)
    with sqlite3.connect(db) as c:
        found = c.execute("SELECT detail FROM events WHERE kind = 'module-input-from' ORDER BY detail").fetchall()
    assert found == [("b: a",), ("c: b",)]
