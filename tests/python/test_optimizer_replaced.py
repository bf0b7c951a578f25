"""Without a scaler, a new optimizer made after attach() over the parameters of the one given
to it (a backbone unfrozen, a fresh AdamW over the whole model) is watched from its first
step: every step is recorded, with event "optimizer-replaced" once. A second optimizer over
other parameters is not, and a replaced optimizer is not kept alive by the handle."""
import gc
import sqlite3
import weakref

import torch
from torch import nn

import ampdiag


def bf16_loop(db, steps, replace_at=None, second=False):
    """A bf16 loop over a two-layer model whose first layer starts frozen; at `replace_at` it
    is unfrozen and a new AdamW over the whole model replaces the first. With `second`, a
    second AdamW steps the first layer alone (not given to attach()). Returns whether the
    optimizer given to attach() was still alive at the end, the handle still open."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model[0].requires_grad_(second)
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-3)
    other = torch.optim.AdamW(model[0].parameters(), lr=1e-3) if second else None
    given = weakref.ref(opt)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with ampdiag.attach(model, optimizer=opt, db=db):
        for step in range(steps):
            if step == replace_at:
                model[0].requires_grad_(True)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if other is not None:
                other.step()
                other.zero_grad()
        gc.collect()
        return given() is not None


def recorded(db):
    with sqlite3.connect(db) as c:
        steps = c.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        events = c.execute("SELECT step FROM events WHERE kind = 'optimizer-replaced'").fetchall()
    return steps, [step for (step,) in events]


def test_a_new_optimizer_over_the_unfrozen_model_is_watched_from_its_first_step(tmp_path):
    bf16_loop(tmp_path / "run.db", 12, replace_at=4)
    assert recorded(tmp_path / "run.db") == (12, [4])


def test_a_second_optimizer_over_other_parameters_is_no_replacement(tmp_path):
    bf16_loop(tmp_path / "run.db", 6, second=True)
    assert recorded(tmp_path / "run.db") == (6, [])


def test_the_replaced_optimizer_is_not_kept_alive_by_the_handle(tmp_path):
    # Its state (AdamW's moments, twice the model) is the user's to free.
    assert not bf16_loop(tmp_path / "run.db", 6, replace_at=2)
