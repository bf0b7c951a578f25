"""A step skipped at a loss scale of 1 or below, whose forward stayed finite, has the module
where its backward went NaN/Inf replayed (forward and backward, as it ran and in FP32) on a
later call's inputs and output gradient: event "backward-replay", "PATH: OUTCOME: DETAIL".
The replay leaves the training as it was."""
import sqlite3

import torch
from torch import nn

import ampdiag


class TanhGelu(nn.Module):  # GPT-2's GELU written out: x ** 3 overflows fp16 above ~40
    def forward(self, h):
        return 0.5 * h * (1 + torch.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))


def mlp(dropout=0.0):
    return nn.Sequential(nn.Linear(16, 64), TanhGelu(), nn.Dropout(dropout), nn.Linear(64, 16))


class PairDistances(nn.Sequential):
    """Encodes, takes each row's distance to every row (sqrt(0) on the diagonal: an infinite
    gradient in any precision) and projects the first 16."""

    def __init__(self):
        super().__init__(nn.Linear(16, 32), nn.Linear(16, 16))

    def forward(self, x):
        z = self[0](x).float()
        diff = z.unsqueeze(1) - z.unsqueeze(0)
        return self[1](diff.square().sum(-1).sqrt()[:, :16])


def replays(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT step, detail FROM events WHERE kind = 'backward-replay'").fetchall()


def train(db, make_block, steps=24, raw_steps=24, **attach):
    """AdamW on make_block(), a LayerNorm, dropout and a head under fp16 autocast with a real
    GradScaler, fed raw readings up to 255 for `raw_steps` steps, then readings scaled to 1.
    Returns the parameters after the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(make_block(), nn.LayerNorm(16), nn.Dropout(0.1), nn.Linear(16, 1))
    opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db, **attach):
        for step in range(steps):
            inputs = 255.0 if step < raw_steps else 1.0
            x = torch.rand(32, 16) * inputs
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), x.mean(1, keepdim=True) / inputs)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return [p.detach().clone() for p in model.parameters()]


def test_an_fp16_intermediate_overflow_absorbed_in_forward_is_replayed_finite_in_fp32(tmp_path):
    db = tmp_path / "gelu.db"
    train(db, mlp)
    [(step, detail)] = replays(db)
    assert detail.startswith("0: finite: float16 autocast: NaN/Inf in ")
    assert detail.endswith("; FP32: 0")
    with sqlite3.connect(db) as c:  # captured on the call after the first skip at a scale of 1
        assert c.execute("SELECT MIN(step) FROM steps WHERE skipped AND scale_before <= 1").fetchone()[0] < step


class TupleBlock(nn.Module):
    """Returns (hidden states, None), as a Hugging Face block returns its outputs."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), TanhGelu(), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))), None


class First(nn.Module):
    def forward(self, outputs):
        return outputs[0]


def test_a_module_returning_a_tuple_is_replayed_on_its_first_floating_point_output(tmp_path):
    db = tmp_path / "tuple.db"
    train(db, lambda: nn.Sequential(TupleBlock(), First()))
    [(_, detail)] = replays(db)
    assert detail.startswith("0.0: finite: "), detail


def test_a_nan_the_module_makes_in_any_precision_is_replayed_intrinsic(tmp_path):
    db = tmp_path / "sqrt.db"
    train(db, PairDistances, raw_steps=0)
    [(_, detail)] = replays(db)
    assert detail.startswith("0: intrinsic: ")
    assert not detail.endswith("FP32: 0")


def test_the_replay_changes_neither_the_weights_nor_the_random_stream(tmp_path):
    # Dropout inside the replayed block: the replay draws its masks from the captured RNG
    # state and puts the stream back, so every later batch and mask is what it would have
    # been. The readings are scaled from step 20 on, and those steps are applied.
    with_replay = train(tmp_path / "on.db", lambda: mlp(dropout=0.1), steps=26, raw_steps=20)
    without = train(tmp_path / "off.db", lambda: mlp(dropout=0.1), steps=26, raw_steps=20, replay=False)
    with sqlite3.connect(tmp_path / "on.db") as c:
        assert c.execute("SELECT COUNT(*) FROM steps WHERE step >= 20 AND NOT skipped").fetchone()[0] > 0
    assert replays(tmp_path / "on.db") and not replays(tmp_path / "off.db")
    assert all(torch.equal(a, b) for a, b in zip(with_replay, without))


def test_a_run_whose_scale_stays_above_1_replays_no_backward(tmp_path):
    # Normalised inputs: at most the scaler's calibration skips, at 65536.
    db = tmp_path / "calm.db"
    train(db, mlp, raw_steps=0)
    assert replays(db) == []


def test_a_module_whose_output_gradient_already_held_nan_is_not_judged(tmp_path):
    # The NaN comes from the distance after enc, which holds no parameter: the first NaN
    # gradient is enc's, the finite one before it the LayerNorm's, and enc is replayed; its
    # output gradient is NaN already, so the replay cannot tell what its own backward does.
    class Distances(nn.Module):
        def forward(self, z):
            z = z.float()
            return ((z[:, None] - z[None]) ** 2).sum(-1).sqrt()[:, :16]

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dist = nn.Linear(16, 32), Distances()

        def forward(self, x):
            return self.dist(self.enc(x))

    db = tmp_path / "above.db"
    train(db, Encoder, raw_steps=0)
    [(_, detail)] = replays(db)
    assert detail == "0.enc: unconfirmed: its inputs or output gradient held NaN/Inf"


def test_a_module_with_a_users_backward_hook_is_not_replayed(tmp_path):
    # The replay runs the module's backward on a copy, which carries its hooks: a user's
    # gradient logger would record a backward the model never ran.
    calls = []

    def logged_mlp():
        block = mlp()
        block.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(1))
        return block

    db = tmp_path / "logged.db"
    train(db, logged_mlp)
    [(_, detail)] = replays(db)
    assert detail.startswith("0: unconfirmed: it, or a module inside it, has a hook that is neither torch's"), detail
    with sqlite3.connect(db) as c:
        backwards = c.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    assert len(calls) == backwards  # one a step: the model's own
