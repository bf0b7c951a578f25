"""A module added to the model after attach() (a block grown, a head swapped in) and given to
the optimizer: its parameters are layers under their own names, with their module, in
backward order from the step after they first arrive, and event "parameters-added" says so
once each. A tensor the model does not hold stays "optimizer.paramN"."""
import sqlite3

import torch
from torch import nn

import ampdiag


class Grown(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.extra = None

    def forward(self, x):
        h = torch.relu(self.body(x))
        if self.extra is not None:
            h = h + self.extra(h)
        return self.head(h)


def amp_step(model, opt, scaler, loose=None):
    """One fp16 step on a random batch; a `loose` tensor's sum joins the loss."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        if loose is not None:
            loss = loss + loose.sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def grow(db, grow_at=2, steps=4, outside=False, gain=1.0):
    torch.manual_seed(0)
    model = Grown()
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    loose = nn.Parameter(torch.zeros(3))
    with ampdiag.attach(model, scaler, db=db):
        for step in range(steps):
            if step == grow_at:
                model.extra = nn.Linear(16, 16)
                with torch.no_grad():
                    model.extra.weight.mul_(gain)
                opt.add_param_group({"params": model.extra.parameters()})
                if outside:
                    opt.add_param_group({"params": [loose]})
            amp_step(model, opt, scaler, loose)


def query(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def test_parameters_added_after_attach_are_layers_under_their_names(tmp_path):
    grow(tmp_path / "run.db")
    layers = query(tmp_path / "run.db", "SELECT name, module_path, module_type FROM layers WHERE id >= 4 ORDER BY id")
    assert layers == [("extra.weight", "extra", "Linear"), ("extra.bias", "extra", "Linear")]
    assert query(tmp_path / "run.db", "SELECT step, detail FROM events WHERE kind = 'foreign-parameter'") == []
    added = query(tmp_path / "run.db", "SELECT step, detail FROM events WHERE kind = 'parameters-added' ORDER BY detail")
    assert [step for step, _ in added] == [2, 2]
    assert added[0][1].startswith("extra.bias was added to the model after attach()")


def test_parameters_added_after_attach_arrive_in_backward_order_from_the_next_step(tmp_path):
    grow(tmp_path / "run.db")
    order = query(tmp_path / "run.db", "SELECT g.step, l.name, g.bwd_order FROM grad_stats g JOIN layers l "
                  "ON l.id = g.layer_id WHERE l.name LIKE 'extra.%' ORDER BY g.step, l.name")
    by_step = {}
    for step, name, bwd in order:
        by_step.setdefault(step, {})[name] = bwd
    assert set(by_step) == {2, 3}
    assert all(bwd < 0 for bwd in by_step[2].values())  # its hook came with the step's unscale
    assert all(bwd >= 0 for bwd in by_step[3].values())
    # extra runs after body in forward, so its gradients arrive before body's in backward
    body = dict(query(tmp_path / "run.db", "SELECT l.name, g.bwd_order FROM grad_stats g JOIN layers l "
                      "ON l.id = g.layer_id WHERE g.step = 3 AND l.name LIKE 'body.%'"))
    assert max(by_step[3].values()) < min(body.values())


def test_a_tensor_the_model_does_not_hold_is_still_a_foreign_parameter(tmp_path):
    grow(tmp_path / "run.db", outside=True)
    names = [name for (name,) in query(tmp_path / "run.db", "SELECT name FROM layers ORDER BY id")]
    assert names[4:6] == ["extra.weight", "extra.bias"] and names[6].startswith("optimizer.param")
    assert len(query(tmp_path / "run.db", "SELECT step FROM events WHERE kind = 'foreign-parameter'")) == 1


def test_a_head_swapped_in_under_the_old_heads_name_is_recorded_as_a_layer_of_its_own(tmp_path):
    # Fine-tuning on new labels: model[2] replaced, a new optimizer. The new tensors take the
    # names of the ones they replace; run.db's layer names are unique, and a clash stopped
    # the writer for the rest of the run.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db"):
        for step in range(4):
            if step == 2:
                model[2] = nn.Linear(16, 3)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            amp_step(model, opt, scaler)
    assert query(tmp_path / "run.db", "SELECT value FROM meta WHERE key = 'write_error'") == []
    names = [name for (name,) in query(tmp_path / "run.db", "SELECT name FROM layers ORDER BY id")]
    assert names[4:] == ["2.weight (from step 2)", "2.bias (from step 2)"]
    added = query(tmp_path / "run.db", "SELECT detail FROM events WHERE kind = 'parameters-added' ORDER BY id")
    assert [d.partition(" was added")[0] for (d,) in added] == names[4:]
    assert query(tmp_path / "run.db", "SELECT COUNT(*) FROM steps") == [(4,)]


def test_modules_added_after_attach_have_their_outputs_watched_from_their_next_call(tmp_path):
    grow(tmp_path / "run.db", gain=1e6)  # its fp16 output is Inf
    nonfinite = query(tmp_path / "run.db", "SELECT a.step, m.path FROM act_stats a JOIN modules m ON m.id = a.module_id "
                      "WHERE a.nan + a.inf > 0 ORDER BY a.step, a.fwd_order")
    first = {}
    for step, path in nonfinite:
        first.setdefault(step, path)
    assert first == {2: "head", 3: "extra"}  # unwatched in the step it came in, named from the next
