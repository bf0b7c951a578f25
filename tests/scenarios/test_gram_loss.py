"""Style transfer's perceptual loss on images in [0, 255]: the transfer network's output
times 255 goes through a frozen convolutional network, and a Gram matrix over each of its
feature maps sums 256 products of values in the hundreds. Under autocast those run in
float16 and pass 65504; the report blamed the multiplication by 255, which on outputs of
about 1 makes no more than a few hundred."""
import torch
from torch import nn
import torch.nn.functional as F

from conftest import amp_training


def gram(features):
    b, c, h, w = features.shape
    flat = features.reshape(b, c, h * w)
    return torch.bmm(flat, flat.transpose(1, 2))  # not divided by c * h * w


def test_a_gram_matrix_overflow_names_the_float16_matmuls_not_the_scaling_to_255(tmp_path, verdict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1), nn.Sigmoid())
    features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
    features.requires_grad_(False)
    style = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        style_gram = gram(features(style * 255))

    def loss_of(g):
        x = torch.rand(2, 3, 16, 16, generator=g)
        return F.mse_loss(gram(features(model(x) * 255)), style_gram.expand(2, -1, -1))

    db = tmp_path / "run.db"
    amp_training(db, model, torch.optim.Adam(model.parameters(), 1e-3), 4, loss_of)
    code, report = verdict(db)
    assert code == 1
    finding = next(f for f in report["findings"] if f["rule"] == "forward-nonfinite")
    first = finding["suggestions"][0]["summary"]
    assert first.startswith("Convolution and Bmm ran in float16 whatever their inputs' dtype"), first
    assert "multiplication by 255" not in first
