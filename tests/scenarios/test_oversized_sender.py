"""A small decoder LM whose head starts 12000 times too large (a gain near 7000): the head's
fp16 backward multiplies the gradient it sends into the final norm by that gain, so the norm's
gradients go NaN/Inf first, through its output. Pinning the norm and the head keeps that one
gradient in FP32, yet every layer before them still takes gradients thousands of times too
large, and the scale still collapses: the report leads with the head's re-initialisation.

DANN's gradient reversal layer, a module without parameters whose autograd.Function sends
back -lambda times the gradient, at a lambda of 1e5: the feature extractor takes gradients
1e5 times too large, the scale collapses and, once it is below 1, the steps it takes make
the loss diverge or the weights grow. The report pointed to the loss and the learning rate;
it leads with the reversal's backward. At lambda 1 the same loop is healthy."""
import torch
from torch import nn
import torch.nn.functional as F

import ampdiag
from conftest import amp_training


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


class Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.lam * grad, None


class GradientReversal(nn.Module):
    def __init__(self, lam):
        super().__init__()
        self.lam = lam

    def forward(self, x):
        return Reverse.apply(x, self.lam)


class Dann(nn.Module):
    def __init__(self, lam):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.classifier, self.grl = nn.Linear(128, 10), GradientReversal(lam)
        self.domain = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, x):
        f = self.features(x)
        return self.classifier(f), self.domain(self.grl(f))


def dann_steps(db, lam):
    torch.manual_seed(0)
    model = Dann(lam)

    def loss_of(g):
        x, y, d = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g), \
            torch.randint(0, 2, (64,), generator=g)
        label, domain = model(x)
        return F.cross_entropy(label.float(), y) + F.cross_entropy(domain.float(), d)

    amp_training(db, model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), 40, loss_of)


def test_a_gradient_reversal_far_too_strong_is_looked_at_before_the_learning_rate(tmp_path, verdict):
    db = tmp_path / "dann.db"
    dann_steps(db, 1e5)
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "overflow-origin", "features.2")
    assert first["suggestions"][0]["summary"].startswith("Look at grl's backward: it holds no parameters")
    collapse = next(f for f in rep["findings"] if f["rule"] == "scale-collapse")
    assert collapse["suggestions"][0]["summary"].startswith("Fix the NaN/Inf made in grl's backward")
    # The loss diverged on the steps taken at scales below 1: the reversal's code before the rate.
    divergence = next(f for f in rep["findings"] if f["rule"] == "loss-divergence")
    assert divergence["suggestions"][0]["summary"] == first["suggestions"][0]["summary"]
    assert divergence["suggestions"][1]["summary"].startswith("Lower the learning rate")


def test_a_gradient_reversal_at_lambda_1_is_healthy(tmp_path, verdict):
    db = tmp_path / "dann.db"
    dann_steps(db, 1.0)
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]
