"""The code a module runs after its submodules, read where its FP32 replay confirmed an fp16
overflow, or found NaN/Inf from finite inputs in FP32 too (event "module-code"): the
operations from its submodules' outputs and its inputs to its output. torch's own leaf
modules are one operation, and a module whose output is its last submodule's ran its own
code before it: neither is read. A leaf of the user's is."""
import sqlite3

import torch
from torch import nn

import ampdiag


def events(db, kind):
    with sqlite3.connect(db) as c:
        return [d for (d,) in c.execute("SELECT detail FROM events WHERE kind = ? ORDER BY step", (kind,))]


class Summed(nn.Module):
    """A Linear's 512 rows summed into one, past fp16's range on inputs up to 400."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).sum(0, keepdim=True) * 2.0


class SummedThenProjected(nn.Module):
    """The same sum, then a Linear: the block's output is its last submodule's."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.lin(x).sum(0, keepdim=True) * 2.0)


class WeightedSum(nn.Module):
    """A leaf of the user's own: its weight applied to the rows (fp16 under autocast), summed."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((8, 8), 0.1))

    def forward(self, x):
        return nn.functional.linear(x, self.w).sum(0, keepdim=True)


class Scaled(nn.Module):
    """A coupling layer's affine transform, its log-scale without a bound: exp() passes
    float32's range too on inputs up to 400."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x * torch.exp(self.lin(x))


class Reparameterised(nn.Module):
    """A head whose outputs its own forward() passes to exp(), as a VAE's exp(0.5 * logvar),
    before another Linear: exp() passes fp16's range on inputs up to 400, and that Linear only
    receives the Inf."""

    def __init__(self):
        super().__init__()
        self.logvar, self.dec = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.dec(torch.exp(0.5 * self.logvar(x)))


class Model(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.head = inner, nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.inner(x)))


def train(db, inner, scale=400.0):
    torch.manual_seed(0)
    model = Model(inner)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-4), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.rand(512, 8) * scale).float().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_a_modules_own_code_after_its_submodules_is_read_once(tmp_path):
    db = tmp_path / "run.db"
    train(db, Summed())
    assert events(db, "module-code") == ["inner: Sum:float16, Mul(2):float16"]


def test_a_torch_leaf_modules_code_is_not_read(tmp_path):
    db = tmp_path / "run.db"
    inner = nn.Linear(8, 8)
    with torch.no_grad():
        inner.weight.mul_(3e4)
    train(db, inner)
    assert events(db, "module-code") == []


def test_a_module_whose_output_is_its_last_submodules_has_no_own_code_read(tmp_path):
    # Its own code ran before that submodule: the report places it between them.
    db = tmp_path / "run.db"
    train(db, SummedThenProjected())
    assert events(db, "module-code") == []


def test_a_leaf_module_of_the_users_own_has_its_code_read(tmp_path):
    db = tmp_path / "run.db"
    train(db, WeightedSum())
    [code] = events(db, "module-code")
    assert code.startswith("inner: ") and ", Mm:float16, Sum:float16" in code, code  # after the weight's cast


def test_a_modules_own_code_is_read_where_it_makes_inf_in_fp32_too(tmp_path):
    db = tmp_path / "run.db"
    train(db, Scaled())
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT module, outcome FROM replays").fetchall()[0] == ("inner", "intrinsic")
    [code] = events(db, "module-code")
    assert code.startswith("inner: ") and "Exp:float16" in code, code


def test_the_code_that_made_the_input_of_a_module_that_only_received_nan_is_read(tmp_path):
    db = tmp_path / "run.db"
    train(db, Reparameterised())
    # (inner's exp() passes float32's range too: inner makes Inf from finite inputs, and the
    # next module to show NaN, head, is looked at in turn.)
    assert events(db, "input-code")[0] == "inner.dec: Mul(0.5):float16, Exp:float16"
