"""SwAV as its reference code writes it: L2-normalised embeddings scored against normalised
prototypes, Sinkhorn-Knopp codes computed under no_grad with exp(scores / 0.05), and the
swapped-prediction loss. Under autocast the scores are float16, and exp() of anything above
11.09 is Inf there: the codes are NaN, and so is every loss. The report names the float16
tensor the loss was given, made outside the model, and the Sinkhorn in FP32 trains healthy."""
import torch
from torch import nn
from torch.nn import functional as F

from conftest import amp_training


class SwAV(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.projection = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32))
        self.prototypes = nn.Linear(32, 50, bias=False)

    def forward(self, x):
        return self.prototypes(F.normalize(self.projection(self.backbone(x)), dim=1))


@torch.no_grad()
def sinkhorn(scores, eps=0.05, iterations=3):
    q = torch.exp(scores / eps).t()
    q /= q.sum()
    for _ in range(iterations):
        q /= q.sum(dim=1, keepdim=True) * q.shape[0]
        q /= q.sum(dim=0, keepdim=True) * q.shape[1]
    return (q * q.shape[1]).t()


def train(db, fp32_codes):
    torch.manual_seed(0)
    model = SwAV()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_of(g):
        with torch.no_grad():
            model.prototypes.weight.copy_(F.normalize(model.prototypes.weight, dim=1))
        x = torch.randn(16, 3, 16, 16, generator=g)
        views = torch.cat([x + 0.1 * torch.randn(x.shape, generator=g), x.flip(-1)])
        scores = model(views)
        loss = 0
        for i in range(2):
            own = scores[16 * i:16 * (i + 1)].detach()
            codes = sinkhorn(own.float() if fp32_codes else own)
            other = scores[16 * (1 - i):16 * (2 - i)]
            loss = loss - torch.mean(torch.sum(codes * F.log_softmax(other.float() / 0.1, dim=1), dim=1))
        return loss / 2

    amp_training(db, model, opt, 10, loss_of)


def test_sinkhorn_codes_in_float16_name_the_float16_tensor_made_outside_the_model(tmp_path, verdict):
    train(tmp_path / "run.db", False)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    forward = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert "already held NaN/Inf, a float16 tensor made outside the model" in forward["title"]
    assert "exp() of anything above 11.09" in forward["suggestions"][0]["summary"]


def test_sinkhorn_codes_in_fp32_train_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", True)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
