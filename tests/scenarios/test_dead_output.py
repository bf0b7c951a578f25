"""A classifier that ends as SqueezeNet's does, a convolution, an in-place ReLU and the
pooling, whose ReLU has died (every input below 0): the logits are all zeros, the loss sits
at ln(10), and backward sends no gradient to any layer. The report told the user to look at
the loss; it names the model's output, all zeros, and the dead ReLU as the likely cause.
Without the ReLU the same loop trains."""
import torch
from torch import nn

from conftest import amp_training


class SqueezeHead(nn.Module):
    def __init__(self, relu_at_end):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        layers = [nn.Dropout(0.5), nn.Conv2d(16, 10, 1)]
        if relu_at_end:
            layers.append(nn.ReLU(inplace=True))
        self.classifier = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        with torch.no_grad():
            self.classifier[1].bias.fill_(-30.0)  # where a step too large left it: every input of the ReLU below 0

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


def squeeze_loop(db, relu_at_end):
    torch.manual_seed(0)
    model = SqueezeHead(relu_at_end)

    def loss_of(g):
        x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
        return nn.functional.cross_entropy(model(x).float(), y)

    amp_training(db, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), 12, loss_of)


def test_a_dead_relu_before_the_output_is_named_as_an_output_of_all_zeros(tmp_path, verdict):
    db = tmp_path / "run.db"
    squeeze_loop(db, relu_at_end=True)
    code, report = verdict(db)
    assert code == 1
    first = report["findings"][0]
    assert (first["rule"], first["severity"]) == ("zero-gradients", "error")
    assert first["title"].endswith("the model's output was all zeros, so backward sent none back, and nothing trains")
    assert "classifier.3's output, the model's last, was all zeros" in first["evidence"]
    assert "classifier.1's, which finished just before it, was not" in first["evidence"]
    assert "a dead ReLU" in first["suggestions"][0]["summary"]


def test_the_same_head_without_the_relu_at_the_end_trains(tmp_path, verdict):
    db = tmp_path / "run.db"
    squeeze_loop(db, relu_at_end=False)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
