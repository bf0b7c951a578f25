"""Inputs that fp16 cannot hold: finite float32 values of 65520 and more turn into Inf where
autocast casts them to float16, before the module that receives them computes anything.
Where that input is the model's own (unnormalised features, as a price column), the report
names the data, with the scaling fix first (event "input-beyond-fp16", '; the model's
input'); where the model's own float32 code made them, it names the module's input."""
import torch
from torch import nn

import ampdiag
from conftest import rows


class PriceRegressor(nn.Module):
    """Tabular regression on raw features: an MLP whose first Linear gets the batch as it is."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.body(x)


class FloatGain(nn.Module):
    """A float32 gain in the model's own code between two Linears: the second one's input
    holds values beyond fp16 that no module made."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.b(self.a(x).float() * 4000.0)


def train(db, model, features, steps=6):
    torch.manual_seed(0)
    opt, scaler = torch.optim.AdamW(model.parameters(), 1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x = features()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), torch.randn(64, 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def raw_prices():
    x = torch.randn(64, 8)
    x[:, 0] = 1e5 + 5e4 * torch.rand(64)  # a price column in currency units
    return x


def beyond(db):
    return [detail for (detail,) in rows(db, "SELECT detail FROM events WHERE kind = 'input-beyond-fp16'")]


def test_a_raw_feature_beyond_fp16_is_recorded_as_the_models_input(tmp_path):
    db = tmp_path / "prices.db"
    torch.manual_seed(0)
    train(db, PriceRegressor(), raw_prices)
    (detail,) = beyond(db)
    assert detail.startswith("body.0: the model's argument 0 (float32 [64, 8]): 64 of 512 values at or beyond 65520, "
                             "max |x| ")
    assert detail.endswith("; the model's input")


def test_a_raw_feature_beyond_fp16_is_reported_as_the_data_with_its_scaling_first(tmp_path, verdict):
    db = tmp_path / "prices.db"
    torch.manual_seed(0)
    train(db, PriceRegressor(), raw_prices)
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "forward-nonfinite", "body.0")
    assert first["title"] == ("The model's input holds values beyond fp16's range: body.0, the first module to use "
                              "them, turns them into Inf")
    assert first["suggestions"][0]["summary"].startswith("Bring the model's input into fp16's range")


def test_the_scaled_features_train_without_an_overflow(tmp_path, verdict):
    db = tmp_path / "scaled.db"
    torch.manual_seed(0)
    train(db, PriceRegressor(), lambda: (raw_prices() - 1.25e5) / 3e4)
    code, rep = verdict(db)
    assert code == 0 and beyond(db) == []


class TwoViews(nn.Module):
    """A siamese encoder called on both of the model's arguments."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, a, b):
        return (self.enc(a) * self.enc(b)).sum(-1, keepdim=True)


def test_an_input_beyond_fp16_is_named_as_the_models_argument_that_holds_it(tmp_path, verdict):
    db = tmp_path / "views.db"
    torch.manual_seed(0)
    model = TwoViews()
    opt, scaler = torch.optim.AdamW(model.parameters(), 1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(64, 8), raw_prices())  # the second view unnormalised
                loss = nn.functional.mse_loss(out.float(), torch.randn(64, 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (detail,) = beyond(db)
    assert detail.startswith("enc.0: the model's argument 1 (float32 [64, 8]): 64 of 512 values")
    code, rep = verdict(db)
    assert rep["findings"][0]["title"].startswith("The model's input holds values beyond fp16's range: enc.0")


def test_values_beyond_fp16_made_by_the_models_own_float32_code_name_the_modules_input(tmp_path, verdict):
    db = tmp_path / "gain.db"
    torch.manual_seed(0)
    train(db, FloatGain(), lambda: torch.randn(64, 8) * 10)
    (detail,) = beyond(db)
    assert detail.startswith("b: argument 0 (float32 [64, 64]): ")
    assert not detail.endswith("; the model's input")
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["module"]) == (1, "b")
    assert first["title"] == "b's input already holds values beyond fp16's range, which it turns into Inf"


class MaskedAttention(nn.Module):
    """Attention given an additive float32 causal mask as Hugging Face builds it (0 where a
    token may attend, torch.finfo(float32).min where not), with query and key weights large
    enough that the fp16 scores overflow."""

    def __init__(self):
        super().__init__()
        self.qk, self.v = nn.Linear(64, 128), nn.Linear(64, 64)
        with torch.no_grad():
            self.qk.weight.mul_(400.0)

    def forward(self, h, mask):
        q, k = self.qk(h).chunk(2, -1)
        weights = (q @ k.transpose(-1, -2) + mask).softmax(-1)
        return weights @ self.v(h)


class MaskedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(8, 64), MaskedAttention(), nn.Linear(64, 1)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
        return self.head(self.attn(self.inp(x), mask)).mean(1)


def test_an_additive_mask_filled_with_float32s_lowest_is_not_read_as_data_beyond_fp16(tmp_path, verdict):
    # The mask's fill is added to the scores, where it stays float32; the overflow is the
    # scores' own, in fp16: the first module whose output is NaN/Inf is the attention.
    db = tmp_path / "masked.db"
    train(db, MaskedLM(), lambda: torch.randn(64, 16, 8))
    assert beyond(db) == []
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "forward-nonfinite", "attn")
    assert first["title"] == "attn is the first module whose output is NaN/Inf in forward"
