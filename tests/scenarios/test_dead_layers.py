"""An MLP whose second ReLU has died (its Linear's bias at -50: every input below 0): the
logits are the last bias alone, the loss sits at ln(10), and every gradient but that bias's
is exactly zero. The report said healthy; it warns that most of the trained values get no
gradient and points at the all-zero input of the last Linear. With the bias at torch's
initialisation the same loop is healthy."""
import torch
from torch import nn

from conftest import amp_training


def mlp_loop(db, dead):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    if dead:
        with torch.no_grad():
            model[2].bias.fill_(-50.0)

    def loss_of(g):
        x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
        return nn.functional.cross_entropy(model(x).float(), y)

    amp_training(db, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), 12, loss_of)


def test_layers_behind_a_dead_relu_are_dead_layers(tmp_path, verdict):
    db = tmp_path / "run.db"
    mlp_loop(db, dead=True)
    code, report = verdict(db)
    assert code == 0
    [finding] = report["findings"]
    assert (finding["rule"], finding["severity"]) == ("dead-layers", "warning")
    assert finding["title"].startswith("5 layers' gradients were exactly zero in every step")
    assert "4's weight got none while its bias did, so its input was all zeros" in finding["evidence"]


def test_the_same_mlp_with_a_live_relu_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    mlp_loop(db, dead=False)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
