"""Two modules whose own backward overflows in the same skipped steps: attention written in
the model's own forward() (scores without 1/sqrt(d)) over inputs 30 times too large, where
q's and k's weight gradients both pass 65504. The skip names k, the first in backward; q's
went NaN/Inf after it, yet not from k (the gradient reaching q's output was finite), so k
pinned alone leaves q overflowing and the report pins them together."""
import torch
from torch import nn
import torch.nn.functional as F

import ampdiag
from conftest import rows


class ScoresAttention(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        return self.out((scores.softmax(-1) @ self.v(x)).mean(1))


def attention_steps(db, pins=(), steps=20):
    torch.manual_seed(0)
    model = ScoresAttention()
    for path in pins:
        ampdiag.pin_fp32(model.get_submodule(path))
    opt, scaler = torch.optim.Adam(model.parameters(), 1e-4), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x, y = torch.randn(4, 32, 128) * 30.0, torch.randint(0, 4, (4,))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            scaler.scale(F.cross_entropy(logits.float(), y)).backward()
            scaler.step(opt)
            scaler.update()


def first_nonfinite(db):
    """The first NaN/Inf gradient in backward order of each skipped step, by step."""
    return dict(rows(db, "SELECT g.step, l.name FROM grad_stats g JOIN layers l ON l.id = g.layer_id "
                         "WHERE g.nan + g.inf > 0 AND g.bwd_order = (SELECT MIN(h.bwd_order) FROM grad_stats h "
                         "WHERE h.step = g.step AND h.nan + h.inf > 0)"))


def test_a_module_overflowing_in_its_own_backward_beside_the_named_one_is_pinned_with_it(tmp_path, verdict):
    db = tmp_path / "attention.db"
    attention_steps(db)
    assert rows(db, "SELECT detail FROM events WHERE kind = 'module-output-gradient'")[-1] == ("k: finite",)
    assert rows(db, "SELECT detail FROM events WHERE kind = 'companion-output-gradient'") == [("q: finite, beside k",)]
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "overflow-origin", "k")
    assert first["title"] == "k overflows first in backward, and q in its own backward in the same steps"
    assert "with the gradient reaching q's output finite: q's own backward overflowed as well" in first["evidence"]
    fix = first["suggestions"][0]
    assert fix["summary"].startswith("Run k and q in FP32 together: pinned alone, k would leave q's overflow")
    assert fix["python"].splitlines() == ["ampdiag.pin_fp32(model.k)  # autocast off inside each; float inputs cast",
                                          "ampdiag.pin_fp32(model.q)"]


def test_k_pinned_alone_leaves_q_overflowing_first(tmp_path):
    # The fix's claim: past the scaler's first calibration skips, q's gradients are the first
    # to go NaN/Inf where k's were.
    db = tmp_path / "k.db"
    attention_steps(db, pins=("k",))
    assert "q.weight" in list(first_nonfinite(db).values())[1:]


def test_k_and_q_pinned_together_leave_only_the_first_calibration_skips(tmp_path, verdict):
    db = tmp_path / "kq.db"
    attention_steps(db, pins=("k", "q"))
    skipped = [s for (s,) in rows(db, "SELECT step FROM steps WHERE skipped = 1")]
    assert skipped == list(range(len(skipped)))  # the scale coming down from 65536, then none
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
