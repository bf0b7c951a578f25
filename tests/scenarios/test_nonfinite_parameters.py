"""NaN/Inf stored in the parameters: written by an optimizer step from finite gradients
(float16 parameters under Adam's default eps, which is 0 in float16), or loaded with the
model. The update or the checkpoint is named, never the module whose weights hold them,
and the fix the report gives is run to show that it holds."""
import torch
from torch import nn

import ampdiag
from conftest import rows, rules


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def train_half(db, steps=6, eps=1e-8, activations=True):
    """model.half() with Adam and no scaler: the loop people write before they meet AMP."""
    torch.manual_seed(0)
    model = Mlp().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    g = torch.Generator().manual_seed(1)
    with ampdiag.attach(model, optimizer=opt, db=db, activations=activations):
        for _ in range(steps):
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x.half()).float(), y)
            loss.backward()
            opt.step()


def train_fp16(db, model, steps, lr, input_scale=1.0):
    """fp16 autocast with a real GradScaler and SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16) * input_scale).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_adam_eps_rounding_to_zero_in_float16_is_named_as_the_update_not_as_a_modules_code(tmp_path, verdict):
    db = tmp_path / "half_adam.db"
    train_half(db)
    code, rep = verdict(db)
    assert code == 1
    assert rules(rep, "error") == [("nonfinite-update", "")]
    update = rep["findings"][0]
    assert update["steps"] == [0]  # its step NaN'd weights the first step had only finite gradients for
    assert "from finite gradients" in update["title"]
    assert "Adam eps=1e-08 is 0 in float16" in update["evidence"]
    assert 'group["eps"] = 1e-4' in update["suggestions"][0]["python"]
    assert rows(db, "SELECT COUNT(*) FROM replays") == [(0,)]  # no replay called NaN weights its code


def test_the_eps_the_report_gives_trains_the_same_loop_healthy(tmp_path, verdict):
    db = tmp_path / "half_adam_eps.db"
    train_half(db, eps=1e-4)
    code, rep = verdict(db)
    assert code == 0, rules(rep)
    assert rows(db, "SELECT COUNT(*) FROM events WHERE kind = 'parameters-nonfinite'") == [(0,)]


def test_without_forward_hooks_the_nan_gradients_lead_to_the_same_update(tmp_path, verdict):
    db = tmp_path / "half_adam_no_activations.db"
    train_half(db, activations=False)
    code, rep = verdict(db)
    assert code == 1
    update = next(f for f in rep["findings"] if f["rule"] == "nonfinite-update")
    assert update["steps"] == [0] and "from finite gradients" in update["title"]


def test_a_checkpoint_holding_nan_is_named_as_the_models_not_a_modules_code(tmp_path, verdict):
    torch.manual_seed(0)
    state = Mlp().state_dict()
    state["b.weight"][3, 5] = float("nan")  # a checkpoint saved after its run diverged
    model = Mlp()
    model.load_state_dict(state)
    db = tmp_path / "nan_checkpoint.db"
    train_fp16(db, model, steps=4, lr=1e-3)
    code, rep = verdict(db)
    assert code == 1
    assert ("nonfinite-parameters", "") in rules(rep, "error")
    found = next(f for f in rep["findings"] if f["rule"] == "nonfinite-parameters")
    assert "1 of 6 parameter tensors: b.weight" in found["evidence"]
    assert {k["forward_source"] for k in rep["skipped_steps"]} == {"update"}  # no module's overflow
    for symptom in (f for f in rep["findings"] if f["rule"] in ("skip-rate", "scale-collapse")):
        assert "(see nonfinite-parameters)" in symptom["suggestions"][0]["summary"]
    assert not {"forward-nonfinite", "overflow-origin"} & {f["rule"] for f in rep["findings"]}


def test_an_fp16_overflow_the_scaler_skips_leaves_the_parameters_finite_and_unsuspected(tmp_path, verdict):
    # A real forward overflow (b's output passes 65504): the scaler skips, nothing is written.
    # The -inf of a mask kept as a frozen parameter is by design, not a NaN/Inf parameter.
    torch.manual_seed(0)
    model = Mlp()
    model.causal_mask = nn.Parameter(torch.full((4, 4), float("-inf")).triu(1), requires_grad=False)
    with torch.no_grad():
        model.b.weight.mul_(3e4)
    db = tmp_path / "forward_overflow.db"
    train_fp16(db, model, steps=3, lr=1e-6, input_scale=4.0)
    assert rows(db, "SELECT COUNT(*) FROM steps WHERE skipped") != [(0,)]
    assert rows(db, "SELECT COUNT(*) FROM events WHERE kind = 'parameters-nonfinite'") == [(0,)]
    assert rows(db, "SELECT module, outcome FROM replays") == [("b", "finite")]  # the overflow is still confirmed
    _, rep = verdict(db)
    assert {f["rule"] for f in rep["findings"]}.isdisjoint({"nonfinite-update", "nonfinite-parameters"})


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.backbone(x).mean((2, 3)))


def train_frozen_batchnorm(db, nan_statistics, reset):
    """A detection-style loop: the backbone's BatchNorm frozen in eval mode, its running
    statistics loaded from a checkpoint saved after a NaN batch."""
    torch.manual_seed(0)
    model = Detector()
    if nan_statistics:
        model.backbone[1].running_var[3] = float("nan")
    if reset:
        model.backbone[1].reset_running_stats()  # the report's fix
    model.backbone.eval()
    opt = torch.optim.SGD(model.head.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(10):  # the scale halves down to 64, below the floor
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, 3, 16, 16)).float()
            scaler.scale(nn.functional.cross_entropy(out, torch.randint(0, 4, (4,)))).backward()
            scaler.step(opt)
            scaler.update()


def test_a_frozen_batchnorms_nan_running_variance_is_named_with_its_reset_not_its_code(tmp_path, verdict):
    db = tmp_path / "frozen_bn.db"
    train_frozen_batchnorm(db, nan_statistics=True, reset=False)
    code, rep = verdict(db)
    assert code == 1
    top = rep["findings"][0]
    assert (top["rule"], top["module"]) == ("forward-nonfinite", "backbone.1")
    assert "because its buffers hold NaN" in top["title"]
    assert "running_var (1 of 8 values NaN)" in top["evidence"]
    assert top["suggestions"][0]["python"] == "model.backbone[1].reset_running_stats()"
    collapse = next(f for f in rep["findings"] if f["rule"] == "scale-collapse")
    assert collapse["suggestions"][0]["summary"].startswith("Fix the NaN/Inf made in backbone.1")


def test_resetting_the_running_statistics_as_the_report_says_trains_healthy(tmp_path, verdict):
    db = tmp_path / "frozen_bn_reset.db"
    train_frozen_batchnorm(db, nan_statistics=True, reset=True)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)
