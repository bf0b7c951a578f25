"""A 1-D convolutional audio autoencoder trained with a multi-resolution STFT loss, the
waveform float16 from autocast and the loss in float32 after it. The log-magnitude's
gradient, 1 / |X|, is cast back down to float16 at the output: Inf at the first scales, and
NaN where the resolutions' Infs of both signs add up. The report called it the loss's
backward at any scale, an error; the scaler's calibration answers it, and the run is healthy."""
import torch
from torch import nn
import torch.nn.functional as F

from conftest import amp_training


def multi_resolution_stft_loss(x, y):
    loss = 0
    for n_fft, hop in ((512, 128), (1024, 256), (256, 64)):
        window = torch.hann_window(n_fft)
        X = torch.stft(x, n_fft, hop, window=window, return_complex=True).abs().clamp_min(1e-7)
        Y = torch.stft(y, n_fft, hop, window=window, return_complex=True).abs().clamp_min(1e-7)
        loss = loss + (Y - X).norm() / Y.norm() + F.l1_loss(X.log(), Y.log())
    return loss


def test_an_stft_loss_whose_gradient_overflows_only_while_the_scale_calibrates_is_healthy(tmp_path, verdict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 32, 7, padding=3), nn.LeakyReLU(0.1), nn.Conv1d(32, 32, 7, padding=3),
                          nn.LeakyReLU(0.1), nn.Conv1d(32, 1, 7, padding=3), nn.Tanh())
    t = torch.arange(8192) / 16000

    def loss_of(g):
        y = torch.sin(2 * torch.pi * (200 + 800 * torch.rand(4, 1, generator=g)) * t) * 0.5
        return multi_resolution_stft_loss(model(y[:, None])[:, 0], y)

    db = tmp_path / "run.db"
    amp_training(db, model, torch.optim.AdamW(model.parameters(), 2e-4, betas=(0.8, 0.99)), 30, loss_of)
    code, report = verdict(db)
    assert report["runs"][0]["skipped"] >= 2
    assert (code, report["healthy"]) == (0, True), report["findings"]
    assert "loss-backward" not in [f["rule"] for f in report["findings"]]
