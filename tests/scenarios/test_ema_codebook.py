"""A VQ-VAE's codebook kept as an exponential moving average, updated in its forward under
no_grad (as VQ-VAE-2 and SoundStream do): under fp16 autocast that update's matmul runs in
float16, and with an encoder whose outputs reach thousands its sums pass 65504, so Inf
lands in the float32 buffers. From the next step on every output is NaN/Inf from finite
inputs, in FP32 too: the module's state, not its code, and the report names the buffers
and the pin that keeps their update in FP32."""
import torch
from torch import nn
import torch.nn.functional as F

from conftest import amp_training, rules


class EmaCodebook(nn.Module):
    def __init__(self, codes=2, dim=8, decay=0.9, dtype=torch.float32):
        super().__init__()
        self.decay = decay
        self.register_buffer("codebook", torch.randn(codes, dim).to(dtype))
        self.register_buffer("cluster_size", torch.ones(codes, dtype=dtype))
        self.register_buffer("embed_sum", self.codebook.clone())

    def forward(self, z):
        distance = (z.float()[:, None, :] - self.codebook[None]).pow(2).sum(-1)
        index = distance.argmin(1)
        quantized = self.codebook[index]
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(index, self.codebook.shape[0]).to(z.dtype)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0).float(), alpha=1 - self.decay)
                self.embed_sum.mul_(self.decay).add_((onehot.t() @ z).float(), alpha=1 - self.decay)
                self.codebook.copy_(self.embed_sum / self.cluster_size.clamp(min=1e-5)[:, None])
        return z + (quantized - z).detach()  # straight-through


class VqAutoencoder(nn.Module):
    def __init__(self, gain, buffers=torch.float32):
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.vq = EmaCodebook(dtype=buffers)
        self.dec = nn.Linear(8, 16)
        with torch.no_grad():
            self.enc.weight.mul_(gain)

    def forward(self, x):
        return self.dec(self.vq(self.enc(x)))


def train(db, gain, pin=False, steps=12, buffers=torch.float32, fix=""):
    import ampdiag
    torch.manual_seed(0)
    model = VqAutoencoder(gain, buffers)
    if pin:
        ampdiag.pin_fp32(model.vq)
    exec(fix, {"model": model, "ampdiag": ampdiag, "torch": torch})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_of(g):
        x = torch.randn(1024, 16, generator=g)  # 512 vectors a code: their fp16 sum passes 65504
        return F.mse_loss(model(x).float(), x)

    amp_training(db, model, opt, steps, loss_of)


def test_an_ema_codebook_updated_in_float16_is_named_for_its_buffers_with_the_pin(tmp_path, verdict):
    db = tmp_path / "vq.db"
    train(db, gain=1000.0)
    code, rep = verdict(db)
    assert code == 1
    top = rep["findings"][0]
    assert (top["rule"], top["module"]) == ("forward-nonfinite", "vq")
    assert top["title"] == "vq makes NaN/Inf from finite inputs because training wrote Inf into its buffers"
    assert "codebook (float32: " in top["evidence"] and "finite at attach())" in top["evidence"]
    assert top["suggestions"][0]["python"].startswith("ampdiag.pin_fp32(model.vq)")


def test_the_same_codebook_pinned_to_fp32_keeps_its_buffers_finite(tmp_path, verdict):
    db = tmp_path / "vq_pinned.db"
    train(db, gain=1000.0, pin=True)
    _, rep = verdict(db)
    assert ("forward-nonfinite", "vq") not in rules(rep)


def test_an_ema_codebook_at_a_standard_scale_trains_healthy(tmp_path, verdict):
    db = tmp_path / "vq_healthy.db"
    train(db, gain=1.0)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


def half_buffers_report(tmp_path, verdict):
    db = tmp_path / "vq_half.db"
    train(db, gain=1000.0, buffers=torch.float16)
    return verdict(db)


def test_float16_buffers_written_inf_are_told_to_be_stored_in_float32_before_the_pin(tmp_path, verdict):
    code, rep = half_buffers_report(tmp_path, verdict)
    assert code == 1
    top = rep["findings"][0]
    assert (top["rule"], top["module"]) == ("forward-nonfinite", "vq")
    assert "(float16: " in top["evidence"]
    fix = top["suggestions"][0]
    assert fix["summary"].startswith("Keep vq's float16 buffers in float32 (")
    assert "model.vq.embed_sum = model.vq.embed_sum.float()" in fix["python"]
    assert "\nampdiag.pin_fp32(model.vq)" in fix["python"]


def test_float16_buffers_under_the_pin_alone_still_take_inf(tmp_path, verdict):
    db = tmp_path / "pinned.db"
    train(db, gain=1000.0, pin=True, buffers=torch.float16)
    _, rep = verdict(db)
    assert ("forward-nonfinite", "vq") in rules(rep)


def test_float16_buffers_train_healthy_with_the_fix_as_the_report_writes_it(tmp_path, verdict):
    _, rep = half_buffers_report(tmp_path, verdict)
    fix = rep["findings"][0]["suggestions"][0]["python"].split("\n# or in plain torch")[0]
    db = tmp_path / "fixed.db"
    train(db, gain=1000.0, buffers=torch.float16, fix=fix)
    code, fixed = verdict(db)
    assert ("forward-nonfinite", "vq") not in rules(fixed), fixed["findings"]


def test_bfloat16_buffers_written_inf_are_told_the_pin_alone(tmp_path, verdict):
    db = tmp_path / "vq_bf16.db"
    train(db, gain=1000.0, buffers=torch.bfloat16)
    code, rep = verdict(db)
    assert code == 1
    top = rep["findings"][0]
    assert (top["rule"], top["module"]) == ("forward-nonfinite", "vq")
    assert "(bfloat16: " in top["evidence"]
    assert top["suggestions"][0]["python"].startswith("ampdiag.pin_fp32(model.vq)")


def test_bfloat16_buffers_under_the_pin_alone_stay_finite(tmp_path, verdict):
    # bfloat16 has float32's range: the Inf was the float16 matmul's, which the pin removes.
    db = tmp_path / "vq_bf16_pinned.db"
    train(db, gain=1000.0, pin=True, buffers=torch.bfloat16)
    _, rep = verdict(db)
    assert ("forward-nonfinite", "vq") not in rules(rep), rep["findings"]
