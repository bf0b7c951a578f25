"""A small pre-norm LM whose feed-forward is a mixture of experts stored as Hugging Face's
fused MoE stores them: one [experts, 2 * hidden, d] parameter `gate_up_proj` and one
[experts, d, hidden] `down_proj` for all experts, in a module `experts` without
reset_parameters(). Its first block's `gate_up_proj` starts 3e4 times too large: the
experts' outputs dwarf the attention's in the residual stream, and the norms after it
shrink every other gradient below fp16's range. The stack is not named as a weight, so
oversized-weights had not looked at it (Phimoe's experts: an underflow warning without its
cause). At Hugging Face's initialisation the same loop is healthy."""
import torch
from torch import nn
import torch.nn.functional as F

from tiny_lm import oversized_lm_run


class Experts(nn.Module):
    def __init__(self, count, d, hidden, std):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(count, 2 * hidden, d) * std)
        self.down_proj = nn.Parameter(torch.randn(count, d, hidden) * std)

    def forward(self, x, expert_ids, weights):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            rows, slot = torch.nonzero(expert_ids == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[rows, slot, None]
            out = out.index_add(0, rows, y.to(out.dtype))
        return out


class MoeBlock(nn.Module):
    def __init__(self, d, std):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.router = nn.Linear(d, 4, bias=False)
        self.experts = Experts(4, d, 2 * d, std)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        h = self.norm2(x).reshape(b * t, d)
        weights, expert_ids = torch.topk(self.router(h).float().softmax(-1), 2, dim=-1)
        return x + self.experts(h, expert_ids, weights).reshape(b, t, d)


def lm_run(db, gain):
    oversized_lm_run(db, lambda d: MoeBlock(d, 0.02), lambda model: model.blocks[0].experts.gate_up_proj, gain)


def test_oversized_stacked_experts_are_named_and_re_initialised_as_a_stack(tmp_path, verdict):
    db = tmp_path / "moe.db"
    lm_run(db, 3e4)
    _, rep = verdict(db)
    oversized = next(f for f in rep["findings"] if f["rule"] == "oversized-weights")
    assert (oversized["severity"], oversized["module"], oversized["layer"]) == (
        "warning", "blocks.0.experts", "blocks.0.experts.gate_up_proj")
    assert "experts' matrices" in oversized["evidence"]
    fix = oversized["suggestions"][0]
    assert fix["summary"].startswith("Initialise blocks.0.experts.gate_up_proj at a standard scale")
    assert "torch.nn.init.normal_(experts.gate_up_proj, std=0.02)" in fix["python"]


def test_stacked_experts_at_hugging_faces_initialisation_are_healthy(tmp_path, verdict):
    db = tmp_path / "moe.db"
    lm_run(db, 1.0)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]
