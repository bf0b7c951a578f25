"""A tied parameter (one tensor held by several modules: an LM's embedding and head) is
looked at in each module's use: a use whose gradient part went NaN/Inf moves the tensor's
arrival to that moment and is event "tied-gradient-nonfinite" naming the module; a part
that stayed finite changes nothing."""
import copy
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag
from ampdiag._tied import tied_owners


class TiedLM(nn.Module):
    def __init__(self, feature_gain=1.0, tie=True):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 64, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.feature_gain = feature_gain  # large features make the head's weight gradient overflow fp16

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)) * self.feature_gain)


def train(db, model, steps=3, activations=True):
    torch.manual_seed(0)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-4), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db, activations=activations):
        for _ in range(steps):
            ids = torch.randint(0, 64, (8, 16))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(ids).float().view(-1, 64), ids.view(-1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def query(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def arrival(db, step):
    """Layer names in the step's backward order."""
    return [name for (name,) in query(db, "SELECT l.name FROM grad_stats g JOIN layers l ON l.id = g.layer_id "
                                          f"WHERE g.step = {step} ORDER BY g.bwd_order")]


@pytest.mark.parametrize("activations", [True, False], ids=["activations", "no-activations"])
def test_the_heads_nan_part_of_a_tied_weight_arrives_first_and_names_the_head(tmp_path, activations):
    db = tmp_path / "run.db"
    torch.manual_seed(0)
    train(db, TiedLM(feature_gain=300.0), activations=activations)
    assert query(db, "SELECT step, detail FROM events WHERE kind = 'tied-gradient-nonfinite' AND step = 0") == \
        [(0, "emb.weight through head")]
    assert query(db, "SELECT skipped FROM steps WHERE step = 0") == [(1,)]
    assert arrival(db, 0)[0] == "emb.weight"


def test_a_tied_weight_whose_parts_stay_finite_arrives_last_without_an_event(tmp_path):
    db = tmp_path / "run.db"
    torch.manual_seed(0)
    train(db, TiedLM())
    assert query(db, "SELECT count(*) FROM events WHERE kind = 'tied-gradient-nonfinite'") == [(0,)]
    assert query(db, "SELECT count(*) FROM steps WHERE skipped = 1") == [(0,)]
    assert arrival(db, 0)[-1] == "emb.weight"  # its first use in forward is the embedding's


def test_tied_owners_are_the_modules_holding_one_tensor_and_none_where_nothing_is_shared():
    torch.manual_seed(0)
    tied = TiedLM()
    assert [[path for path, _ in held] for held in tied_owners(tied).values()] == [["emb", "head"]]
    assert tied_owners(TiedLM(tie=False)) == {}


def test_a_tied_model_deep_copied_after_attach_copies_and_trains_on(tmp_path):
    # An EMA teacher: deepcopy copies the module's hooks, which must not drag the handle along.
    db = tmp_path / "run.db"
    torch.manual_seed(0)
    model = TiedLM()
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-4), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        teacher = copy.deepcopy(model)
        for _ in range(2):
            ids = torch.randint(0, 64, (8, 16))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                with torch.no_grad():
                    target = teacher(ids).float().softmax(-1)
                loss = nn.functional.cross_entropy(model(ids).float().view(-1, 64), target.view(-1, 64))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert query(db, "SELECT count(*) FROM steps") == [(2,)]
    assert teacher.head.weight is teacher.emb.weight  # still tied, to its own tensor
