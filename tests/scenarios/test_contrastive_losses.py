"""Contrastive losses under fp16 autocast (InfoNCE, SimCLR's NT-Xent): similarities whose
matmul autocast keeps in float16, a temperature that enlarges their backward, and the mask
written into a float16 tensor. Named in the loss code, with the FP32 loss or the dtype's own
limit as the fix, and healthy where the scaler answers it."""
import math

import pytest
import torch
from torch import nn

from conftest import rows, rules
from fp16_loop import train


def test_a_contrastive_losss_float16_similarities_get_the_fp32_loss_with_autocast_off_first(tmp_path, verdict):
    # z_a @ z_b.T / 0.07 under autocast: the matmul runs in fp16 however its inputs are
    # cast, and embeddings of norm ~300 make dot products beyond 65504.
    db = tmp_path / "infonce.db"
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64))
    with torch.no_grad():
        encoder[2].weight.mul_(30)

    def loss_of(step, model):
        x = torch.randn(64, 32)
        with torch.autocast("cpu", dtype=torch.float16):
            za, zb = model(x + 0.1 * torch.randn_like(x)), model(x + 0.1 * torch.randn_like(x))
            return nn.functional.cross_entropy(za @ zb.T / 0.07, torch.arange(64))

    train(db, encoder, 6, loss_of)
    code, rep = verdict(db)
    assert code == 1
    top = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert "Mm (float16), Div (float16)" in top["evidence"]
    assert top["suggestions"][0]["summary"].startswith("Mm and Div ran in float16")
    assert "enabled=False" in top["suggestions"][0]["python"]


def test_a_contrastive_loss_whose_fp16_backward_overflows_only_at_the_first_scales_is_healthy(tmp_path, verdict):
    # SimCLR's NT-Xent at a temperature of 0.01 (CLIP's learnt one ends near it), under
    # autocast: the scaled gradient times 100 overflows the float16 similarities' backward at
    # 65536, NaN at the model's output, and no more once the scaler has come down.
    db = tmp_path / "ntxent.db"
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(768, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                            nn.Linear(256, 64))

    def loss_of(step, model):
        x = torch.randn(64, 3, 16, 16)
        with torch.autocast("cpu", dtype=torch.float16):
            z = nn.functional.normalize(torch.cat([model(x + 0.1 * torch.randn_like(x)), model(x.flip(-1))]), dim=1)
            sim = (z @ z.t() / 0.01).masked_fill(torch.eye(128, dtype=torch.bool), float("-inf"))
            return nn.functional.cross_entropy(sim.float(), torch.cat([torch.arange(64, 128), torch.arange(64)]))

    train(db, encoder, 40, loss_of)
    assert rows(db, "SELECT COUNT(*) FROM events WHERE kind = 'output-gradient-nonfinite'")[0][0] >= 1  # the case
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)


def contrastive_with_masked_diagonal(db, fill):
    """SimCLR's NT-Xent under fp16 autocast: each view's similarity with itself masked by
    `fill(sim)` before the cross-entropy."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64))
    target = torch.cat([torch.arange(16, 32), torch.arange(16)])

    def loss_of(step, model):
        x = torch.randn(16, 32)
        with torch.autocast("cpu", dtype=torch.float16):
            z = nn.functional.normalize(model(torch.cat([x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)])),
                                        dim=-1)
            sim = z @ z.t() / 0.07
            return nn.functional.cross_entropy(sim.masked_fill(torch.eye(32, dtype=torch.bool), fill(sim)), target)

    train(db, enc, 6, loss_of)


def test_a_mask_of_minus_1e9_on_float16_similarities_stops_the_run_and_the_report_gives_the_dtypes_limit(tmp_path,
                                                                                                          ampdiag):
    db = tmp_path / "run.db"
    with pytest.raises(RuntimeError, match="Half without overflow"):
        contrastive_with_masked_diagonal(db, lambda sim: -1e9)
    result = ampdiag("report", db)
    assert result.returncode == 2
    assert "A constant beyond float16's range (65504) was written into a float16 tensor" in result.stderr
    assert "masked_fill(mask, torch.finfo(scores.dtype).min)" in result.stderr


def test_the_dtypes_own_limit_as_the_report_gives_it_trains_the_contrastive_loop_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    contrastive_with_masked_diagonal(db, lambda sim: torch.finfo(sim.dtype).min)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]


class TwoTowers(nn.Module):
    """CLIP's shape: two encoders, normalised embeddings, their similarities times the
    model's own learnt temperature exp(logit_scale), and the symmetric loss in forward()."""

    def __init__(self, logit_scale):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 32))
        self.text = nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 32))
        self.logit_scale = nn.Parameter(torch.tensor(float(logit_scale)))

    def forward(self, images, texts):
        a = nn.functional.normalize(self.image(images), dim=-1)
        b = nn.functional.normalize(self.text(texts), dim=-1)
        logits = a @ b.t() * self.logit_scale.exp()
        target = torch.arange(len(a))
        return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.t(), target)) / 2


def train_two_towers(db, logit_scale):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 48, generator=g), torch.randn(16, 24, generator=g)) for _ in range(24)]

    def loss_of(step, model):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(*data[step])

    train(db, TwoTowers(logit_scale), 24, loss_of)


def test_a_learnt_temperature_whose_exp_overflows_the_similarities_backward_is_told_to_be_bounded(tmp_path, verdict):
    # logit_scale at 11.5: exp() is ~98716, the similarities' fp16 backward overflows at every
    # scale down to 2, and the last encoder layer only receives the Inf through its output.
    # Its pin would stop at the matmul, which autocast keeps in fp16, before the Mul that
    # overflows (tried on Hugging Face's CLIPModel: pinned, its text_projection still
    # receives it).
    db = tmp_path / "towers.db"
    train_two_towers(db, 11.5)
    code, rep = verdict(db)
    assert code == 1
    top = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert top["module"] in ("image.2", "text.2")
    assert "it reads the model's own logit_scale: 11.5 (float32, 1 value), read by Exp" in top["evidence"]
    fixes = [s["summary"] for s in top["suggestions"]]
    assert fixes[0].startswith("Bound logit_scale before its exp(): the code after " + top["module"] +
                               " reads it through exp()"), fixes
    assert "self.logit_scale.clamp(max=math.log(100)).exp()" in top["suggestions"][0]["python"]
    # The other tower's gradients hold the scale below the floor too: neither the pin nor the
    # similarities in FP32 (tried: the scale still down to 8) is offered, only bf16 after the bound.
    assert "so pinning " + top["module"] + " alone would leave the scale below the floor" in top["evidence"]
    assert fixes[1].startswith("Or train in bfloat16"), fixes
    assert len(fixes) == 2, fixes


def test_the_temperature_bounded_as_the_report_says_trains_the_two_towers_healthy(tmp_path, verdict):
    db = tmp_path / "towers.db"
    train_two_towers(db, math.log(100))
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)
