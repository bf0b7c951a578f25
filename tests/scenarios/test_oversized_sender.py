"""A small decoder LM whose head starts 12000 times too large (a gain near 7000): the head's
fp16 backward multiplies the gradient it sends into the final norm by that gain, so the norm's
gradients go NaN/Inf first, through its output. Pinning the norm and the head keeps that one
gradient in FP32, yet every layer before them still takes gradients thousands of times too
large, and the scale still collapses: the report leads with the head's re-initialisation."""
import torch
from torch import nn
import torch.nn.functional as F

import ampdiag


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.n1(x)
        x = x + self.o(F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h), is_causal=True))
        return x + self.down(F.silu(self.up(self.n2(x))))


class Decoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.embed, self.layers, self.norm = nn.Embedding(256, d), nn.ModuleList([Block(d), Block(d)]), nn.RMSNorm(d)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.norm(x)


class TinyLM(nn.Module):
    def __init__(self, head_gain, d=64):
        super().__init__()
        self.model, self.head = Decoder(d), nn.Linear(d, 256, bias=False)
        with torch.no_grad():
            self.head.weight.mul_(head_gain)

    def forward(self, ids):
        return self.head(self.model(ids))


def lm_steps(db, head_gain=12000.0, pins=(), activations=True):
    torch.manual_seed(0)
    model = TinyLM(head_gain)
    for path in pins:
        ampdiag.pin_fp32(model.get_submodule(path))
    opt, scaler = torch.optim.AdamW(model.parameters(), 3e-4), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, optimizer=opt, db=db, activations=activations):
        for _ in range(30):
            ids = torch.randint(0, 256, (4, 24))
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), ids[:, 1:].reshape(-1))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)


def test_a_sender_whose_weights_start_far_too_large_is_re_initialised_first(tmp_path, verdict):
    db = tmp_path / "lm.db"
    lm_steps(db)
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "overflow-origin", "model.norm")
    assert first["title"].endswith("they reach it through its output: head's backward makes them")
    assert first["suggestions"][0]["python"].startswith('model.get_submodule("head").reset_parameters()')
    assert first["suggestions"][1]["summary"].startswith("Where that gain is by design, run model.norm and head in FP32")


def test_without_activations_the_head_is_re_initialised_first_by_the_backward_order(tmp_path, verdict):
    # No module hooks, so no look at the norm's output gradient: the head's gradient arriving
    # before the norm's NaN/Inf one says it runs after the norm in forward.
    db = tmp_path / "lm_no_activations.db"
    lm_steps(db, activations=False)
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"]) == (1, "overflow-origin")
    assert first["suggestions"][0]["python"].startswith('model.get_submodule("head").reset_parameters()')
    assert first["suggestions"][1]["summary"].startswith("Where that gain is by design, run ")


def test_the_norm_and_the_head_pinned_still_collapse_the_scale(tmp_path, verdict):
    # The pin the report offers second: it holds only the head's own gradient in FP32.
    db = tmp_path / "lm_pinned.db"
    lm_steps(db, pins=("model.norm", "head"))
    code, rep = verdict(db)
    assert code == 1
    assert any(f["rule"] == "scale-collapse" for f in rep["findings"])


def test_the_head_at_a_standard_initialisation_keeps_the_scale_up(tmp_path, verdict):
    db = tmp_path / "lm_reset.db"
    lm_steps(db, head_gain=1.0)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
