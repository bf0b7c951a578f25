"""A batch-hard triplet loss on normalised embeddings, its pairwise distances written out as
sqrt of summed squares: each embedding's distance to itself is sqrt(0), whose gradient is
infinite, and every step is skipped. The report's first fix was F.normalize's division by
0, whose norms are far from 0; the agent now traces the loss backward's origin, and the sqrt
leads. Its fix, a clamp in float32 in an FP32 loss, trains."""
import torch
from torch import nn
import torch.nn.functional as F

from conftest import amp_training

LABELS = torch.arange(8).repeat_interleave(4)


def batch_hard(d):
    same = LABELS[:, None] == LABELS[None]
    return F.relu((d * same).max(1).values - (d + 1e4 * same).min(1).values + 0.2).mean()


def train(tmp_path, verdict, distances):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    centres = torch.randn(8, 32)

    def loss_of(g):
        e = F.normalize(model(centres[LABELS] + 0.5 * torch.randn(32, 32, generator=g)), dim=-1)
        return batch_hard(distances(e))

    db = tmp_path / "run.db"
    amp_training(db, model, torch.optim.Adam(model.parameters(), 1e-3), 12, loss_of)
    return verdict(db)


def test_a_distance_to_itself_leads_with_the_sqrt_not_the_normalisation(tmp_path, verdict):
    code, report = train(tmp_path, verdict, lambda e: (e[:, None] - e[None]).pow(2).sum(-1).sqrt())
    assert code == 1
    finding = next(f for f in report["findings"] if f["rule"] == "loss-backward")
    assert "Sqrt (float16) was the first of it whose backward sent NaN/Inf back" in finding["evidence"]
    assert finding["suggestions"][0]["summary"].startswith("sqrt()'s gradient at 0 is infinite")


def test_the_distance_clamped_in_float32_trains_healthy(tmp_path, verdict):
    def clamped(e):
        with torch.autocast("cpu", enabled=False):
            e = e.float()
            return ((e[:, None] - e[None]).pow(2).sum(-1) + 1e-12).sqrt()

    code, report = train(tmp_path, verdict, clamped)
    assert (code, report["healthy"]) == (0, True), report["findings"]
