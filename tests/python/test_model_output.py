"""The model-output look (see _forward.look_at_model_output): which model outputs it reads
for NaN/Inf. The last module's output is its hook's; a view or an upcast of it holds the
same values and is not read again (an LM's logits.float().view(-1, V) is the largest
tensor of its step); anything the model computes after its last module is."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag
import ampdiag._forward


class Tail(nn.Module):
    def __init__(self, tail):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.tail = tail

    def forward(self, x):
        return self.tail(self.head(torch.relu(self.body(x))))


def reads_of_the_model_output(tmp_path, monkeypatch, tail, steps=3):
    reads = []
    real = ampdiag._forward.holds_nonfinite
    monkeypatch.setattr(ampdiag._forward, "holds_nonfinite", lambda s, t: reads.append(t.shape) or real(s, t))
    torch.manual_seed(0)
    model = Tail(tail)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db"):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(6, 8)).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return reads


@pytest.mark.parametrize("tail", [lambda y: y, lambda y: y.float().view(-1), lambda y: y.t().contiguous()[1:]],
                         ids=["itself", "upcast-view", "transposed-slice"])
def test_the_last_modules_output_viewed_or_cast_up_is_not_read_again(tmp_path, monkeypatch, tail):
    assert reads_of_the_model_output(tmp_path, monkeypatch, tail) == []


@pytest.mark.parametrize("tail", [lambda y: y.exp(), lambda y: y.float().half(), lambda y: y.sum(-1)],
                         ids=["computed", "cast-down", "reduced"])
def test_an_output_the_model_computes_after_its_last_module_is_read_every_step(tmp_path, monkeypatch, tail):
    assert len(reads_of_the_model_output(tmp_path, monkeypatch, tail)) == 3


def test_the_module_outputs_graph_nodes_are_not_kept_past_the_models_forward(tmp_path):
    # An evaluation with gradients on (no backward) must not keep each batch's graph alive
    # until the next step ends.
    torch.manual_seed(0)
    model = Tail(lambda y: y.exp())
    with ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "run.db") as handle:
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.randn(6, 8))
        assert (handle._module_nodes, handle._last_node) == ([], None)


class OwnProjection(nn.Module):
    """A projection the model holds itself, applied after its last module; autocast casts it
    to float16 for the matmul, which overflows."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 32)
        self.proj = nn.Parameter(torch.full((32, 4), 1000.0))
        self.bias = nn.Parameter(torch.zeros(4))  # not read by that code: not named

    def forward(self, x):
        return self.body(x) @ self.proj


def test_the_models_own_parameter_read_after_its_modules_is_named_by_the_operation_not_its_cast(tmp_path):
    torch.manual_seed(0)
    model = OwnProjection()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db"):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(6, 8) * 100).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    with sqlite3.connect(tmp_path / "run.db") as db:
        details = [d for (d,) in db.execute("SELECT detail FROM events WHERE kind = 'model-parameters'")]
    assert details == ["proj: |x| up to 1000 (float32, 128 values), read by Mm"]
