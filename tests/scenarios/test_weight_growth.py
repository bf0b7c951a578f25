"""A learning rate far too high (AdamW at 0.3): every step moves each weight by about 0.3,
the weights grow until the backward overflows fp16 and the scale collapses. The report
named the last layer as where the overflow starts and asked to pin it; the loss had barely
grown, so nothing said why. With the weights sampled, the growth is the finding and the
fix lowers the learning rate; the same loop at 1e-3 is healthy."""
import torch
from torch import nn

import ampdiag
from conftest import amp_training, rules


def train(db, lr):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    amp_training(db, model, opt, 30, lambda g: nn.functional.cross_entropy(
        model(torch.randn(64, 32, generator=g)).float(), torch.randint(0, 10, (64,), generator=g)))


def test_weights_grown_by_a_learning_rate_far_too_high_are_the_first_finding(tmp_path, verdict):
    train(tmp_path / "run.db", 0.3)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("weight-growth", "error")
    assert "optimizer: AdamW lr=0.3" in first["evidence"]
    assert first["suggestions"][0]["python"].startswith("optimizer = torch.optim.AdamW(model.parameters(), lr=0.03)")
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["severity"] == "warning"
    assert origin["suggestions"][0]["summary"].startswith("The weights were growing (see weight-growth)")


def test_the_same_loop_at_a_sane_learning_rate_is_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", 1e-3)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
    assert "weight-growth" not in [rule for rule, _ in rules(rep)]


class TiedLM(nn.Module):
    """A small causal LM whose head shares the token embedding's weight, as GPT-2's does."""

    def __init__(self, vocab=500, d=128):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 256, dropout=0.0, batch_first=True, norm_first=True)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, ids):
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.norm(self.block(h, src_mask=mask, is_causal=True)))


def test_a_tied_heads_backward_overflow_does_not_hide_the_growth(tmp_path, verdict):
    # The first skips name head, whose weight is the embedding's, so no weights of its own
    # were sampled: the report read the overflows alone, with head's pin, and no growth.
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.3)
    amp_training(tmp_path / "lm.db", model, opt, 40, lambda g: nn.functional.cross_entropy(
        model(ids := torch.randint(0, 500, (8, 64), generator=g))[:, :-1].float().reshape(-1, 500),
        ids[:, 1:].reshape(-1)))
    code, rep = verdict(tmp_path / "lm.db")
    assert code == 1
    assert any(f["rule"] == "overflow-origin" and f["module"] == "head" for f in rep["findings"])
    assert rep["findings"][0]["rule"] == "weight-growth"


def train_one_cycle(db, peak, steps=40):
    """SGD with momentum under OneCycleLR: the rate starts at peak / 25, reaches `peak` at
    40 % of 120 steps, the gradients clipped the usual way (unscale_, clip_grad_norm_)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=peak, total_steps=120, pct_start=0.4)
    scaler = torch.amp.GradScaler("cpu")
    target = torch.randn(32, 10)
    with ampdiag.attach(model, scaler, optimizer=opt, db=str(db)):
        for _ in range(steps):
            x = torch.randn(64, 32)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), (x @ target).argmax(1))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            scaler.step(opt)
            scaler.update()
            schedule.step()


def test_a_one_cycle_schedule_whose_peak_is_far_too_high_is_weight_growth_at_the_rate_it_reached(tmp_path, verdict):
    # The loss went NaN while it had grown ~40x, and one finite loss between the NaNs (at a
    # lowered scale) was 1000x the start: that is no divergence "while finite". The rate the
    # weights grew under is the schedule's, not the 1.2 of its first step.
    train_one_cycle(tmp_path / "run.db", peak=30.0)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    assert "loss-divergence" not in [rule for rule, _ in rules(rep)]
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("weight-growth", "error")
    assert "(lr=1.2 at step 0: a schedule moved it)" in first["evidence"]
    assert "lower the schedule's peak as much" in first["suggestions"][0]["python"]


def test_the_same_schedule_at_a_sane_peak_is_healthy(tmp_path, verdict):
    train_one_cycle(tmp_path / "run.db", peak=0.05)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]


class TokenClassifier(nn.Module):
    """Three pre-norm transformer layers over 32 tokens, mean-pooled into a 5-way head."""

    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(1000, 128), nn.Parameter(torch.zeros(1, 32, 128))
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, norm_first=True), 3,
                                         enable_nested_tensor=False)
        self.head = nn.Linear(128, 5)

    def forward(self, ids):
        return self.head(self.enc(self.emb(ids) + self.pos).mean(1))


def train_classifier(db, lr):
    torch.manual_seed(0)
    model = TokenClassifier()

    def loss_of(g):
        ids = torch.randint(0, 1000, (32, 32), generator=g)
        return nn.functional.cross_entropy(model(ids), ids[:, 0] % 5)

    amp_training(db, model, torch.optim.AdamW(model.parameters(), lr=lr), 45, loss_of)


def test_a_first_step_as_large_as_the_weights_that_raises_the_loss_is_weight_growth(tmp_path, verdict):
    # AdamW at 0.1 moves every weight by about 0.1, on weights of RMS 0.06: the cross-entropy
    # goes from 1.7 to 104 in that step, and the weights grow less than 8x before the scale
    # collapses. The report told to shrink the loss and normalise the targets.
    train_classifier(tmp_path / "run.db", 0.1)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("weight-growth", "error"), first["title"]
    assert "in one step (step 0)" in first["title"]
    assert first["suggestions"][0]["python"].startswith("optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)")


def test_the_same_classifier_at_a_tenth_of_that_rate_is_healthy(tmp_path, verdict):
    train_classifier(tmp_path / "run.db", 0.01)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
