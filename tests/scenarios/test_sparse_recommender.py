"""A DLRM-style recommender as such loops are written: sparse EmbeddingBags (sparse=True)
under SparseAdam, a dense MLP under Adam, one GradScaler stepping both, and the features'
pairwise interaction as a bmm in the model's own forward(). Healthy, its sparse gradients
are read like dense ones. With one table 3000 times torch's scale, the interaction's fp16
bmm overflows: the report had only said to look at the model's forward(); it now names the
table whose outputs are too large and says why the bmm in FP32 alone would not do."""
import torch
from torch import nn

import ampdiag


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.embs = nn.ModuleList(nn.EmbeddingBag(1000, 16, mode="sum", sparse=True) for _ in range(3))
        self.bottom = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.top = nn.Sequential(nn.Linear(16 * 4 + 6, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense, ids, offsets):
        x = self.bottom(dense)
        feats = [x] + [e(i, o) for e, i, o in zip(self.embs, ids, offsets)]
        stacked = torch.stack(feats, 1)
        pairs = torch.bmm(stacked, stacked.transpose(1, 2))
        upper = torch.triu_indices(4, 4, 1)
        return self.top(torch.cat(feats + [pairs[:, upper[0], upper[1]]], 1))


def train(db, table_gain):
    torch.manual_seed(0)
    model = Recommender()
    with torch.no_grad():
        model.embs[0].weight.mul_(table_gain)
    sparse = torch.optim.SparseAdam(list(model.embs.parameters()), lr=1e-2)
    dense = torch.optim.Adam(list(model.bottom.parameters()) + list(model.top.parameters()), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with ampdiag.attach(model, scaler, dense, db=db):
        for _ in range(12):
            ids = [torch.randint(0, 1000, (64 * 3,), generator=g) for _ in range(3)]
            offsets = [torch.arange(0, 64 * 3, 3)] * 3
            x, y = torch.randn(64, 8, generator=g), torch.randint(0, 2, (64, 1), generator=g).float()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.binary_cross_entropy_with_logits(model(x, ids, offsets).float(), y)
            scaler.scale(loss).backward()
            scaler.step(sparse)
            scaler.step(dense)
            scaler.update()
            sparse.zero_grad()
            dense.zero_grad()


def test_sparse_embeddings_under_sparse_adam_train_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", 1.0)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]


def test_an_interaction_bmm_over_a_table_far_too_large_names_the_table(tmp_path, verdict):
    train(tmp_path / "run.db", 3000.0)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 1
    forward = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert "between embs.2 and top.0" in forward["title"]
    fix = forward["suggestions"][0]["summary"]
    assert fix.startswith("Bring embs.0's outputs down") and "in Bmm" in fix and "embs.0.weight's RMS is" in fix
    assert fix.endswith("would hand its product on to top.0 (Linear), which autocast runs in float16 too.")
