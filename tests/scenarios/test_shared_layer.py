"""ALBERT's cross-layer sharing, as Hugging Face writes it: one layer run four times a
forward, each call on the last one's output, with its activation the tanh GELU written with a
cube (`gelu_new`). Its FFN's weights 1e4 times too large give the activation inputs around
2e4, whose cube overflows fp16: the forward stays finite (tanh of Inf is 1), and the
backward makes 0 times Inf, NaN, at every loss scale. The shared parameters get their
gradient only after all four calls' backward, so the first of them to hold NaN was the
layer's last norm, and the report told the user to look in the norm's backward for a sqrt of
0. It must name the shared layer and offer first the activation's FP32 pin, which makes the
run healthy."""
import math

import torch
from torch import nn

import ampdiag as agent  # the fixture `ampdiag` is the CLI
from conftest import amp_training


class NewGelu(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Layer(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ffn, self.act, self.ffn_output, self.norm = nn.Linear(d, 2 * d), NewGelu(), nn.Linear(2 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.ffn_output(self.act(self.ffn(x))))


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.layer, self.head = nn.Linear(16, 64), Layer(), nn.Linear(64, 4)
        with torch.no_grad():
            self.layer.ffn.weight.mul_(1e4)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(4):
            h = self.layer(h)
        return self.head(h)


def shared_layer_run(db, pin_activation=False, steps=24):
    torch.manual_seed(0)
    model = Shared()
    if pin_activation:
        agent.pin_fp32(model.layer.act)

    def loss_of(g):
        return nn.functional.cross_entropy(model(torch.randn(32, 16, generator=g)), torch.randint(0, 4, (32,), generator=g))

    amp_training(db, model, torch.optim.AdamW(model.parameters(), lr=1e-4), steps, loss_of)


def test_a_shared_layer_whose_backward_makes_nan_is_named_whole_with_its_activation_pinned(tmp_path, top_finding):
    shared_layer_run(tmp_path / "run.db")
    code, first = top_finding(tmp_path / "run.db")
    assert (code, first["rule"], first["module"]) == (1, "overflow-origin", "layer")
    assert "layer runs again and again in each forward, each call taking the last one's output" in first["evidence"]
    # The activation's inputs, near 2e4, are the evidence: its pin comes before the look for a sqrt of 0.
    pin, look = first["suggestions"][:2]
    assert pin["summary"].startswith("Run layer.act in FP32: layer.act computes on values up to"), pin["summary"]
    assert pin["python"].startswith("ampdiag.pin_fp32(model.layer.act)")
    assert look["summary"].startswith("If pinned it still goes NaN/Inf, look at the backward of layer.act")


def test_the_shared_layers_activation_pinned_as_the_report_says_is_healthy(tmp_path, verdict):
    db = tmp_path / "run.db"
    shared_layer_run(db, pin_activation=True)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
