"""Weights initialised far below float16's smallest positive value (2^-24), as Hugging Face's
BLIP vision config does by default (initializer_range=1e-10, for loading pretrained weights): autocast casts them to zeros, the layers compute zeros, and
nothing overflows. A BLIP built from its config had its vision tower called 100 % lost to
float16 by the precision check, with only a pin as the fix; the report now names the
weights, and says whether the optimizer lifted them or they never train."""
import torch
from torch import nn

from conftest import amp_training


class Captioner(nn.Module):
    """Patch features through a vision tower (a projection, a norm, a bias-free MLP on a
    residual), token embeddings, one joint transformer layer, an LM head."""

    def __init__(self):
        super().__init__()
        self.vision = nn.ModuleDict(dict(
            patch=nn.Linear(48, 64, bias=False), norm=nn.LayerNorm(64),
            mlp=nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))))
        self.embed = nn.Embedding(256, 64)
        self.joint = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 256)

    def forward(self, patches, ids):
        v = self.vision["norm"](self.vision["patch"](patches))
        v = v + self.vision["mlp"](v)
        h = self.joint(torch.cat([v, self.embed(ids)], 1))
        return self.head(h[:, patches.shape[1]:])


def train(db, tiny):
    """`tiny`: the vision layers initialised as BLIP's config does, normal(0, 1e-10)."""
    torch.manual_seed(0)
    model = Captioner()
    with torch.no_grad():
        for name in tiny:
            nn.init.normal_(model.vision.get_submodule(name).weight, std=1e-10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of(g):
        patches, ids = torch.randn(8, 4, 48, generator=g), torch.randint(0, 256, (8, 13), generator=g)
        logits = model(patches, ids[:, :-1]).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    amp_training(db, model, opt, 12, loss_of)


def test_weights_below_float16s_range_that_never_train_are_an_error(tmp_path, verdict):
    # The MLP has no biases: its first layer's zeros make its second's input zeros, and the
    # gradient of each is the other's zeros, so neither ever leaves 1e-10.
    train(tmp_path / "run.db", ["mlp.0", "mlp.2"])
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"], first["module"]) == ("flushed-weights", "error", "vision.mlp")
    assert "below float16's smallest value (5.96e-08) from step 0" in first["title"]
    assert "gradient was exactly zero in every recorded step" in first["evidence"]
    assert "reset_parameters()" in first["suggestions"][0]["python"]


def test_weights_below_float16s_range_that_the_optimizer_lifts_are_a_warning(tmp_path, verdict):
    train(tmp_path / "run.db", ["patch"])
    code, rep = verdict(tmp_path / "run.db")
    assert code == 0
    flushed = [f for f in rep["findings"] if f["rule"] == "flushed-weights"]
    assert [(f["severity"], f["layer"]) for f in flushed] == [("warning", "vision.patch.weight")]
    assert flushed[0]["title"].endswith("until the optimizer's steps lifted it, by step 1")


def test_the_same_layers_reset_as_the_fix_says_train_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", [])
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
