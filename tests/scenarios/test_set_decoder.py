"""A DETR-shaped detector: a conv backbone, an encoder layer, and post-norm decoder layers
whose queries start as zeros beside learnt query positions, with torch's MultiheadAttention
and a loss on every decoder layer's output. The first decoder layer's self-attention over
zeros makes zeros, its LayerNorm normalises an input without spread and multiplies the
gradient it sends back by 1/sqrt(eps), and the self-attention's output projection's bias
then holds the scale at 256, where its input projection underflows. The report told to
train in bf16 only, and named out_proj, whose forward MultiheadAttention never calls; it
now tells to pin the self-attention, and pinned, the loop is healthy at 65536."""
import torch
import torch.nn.functional as F
from torch import nn

import ampdiag
from conftest import amp_training


class DecoderLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm1 = nn.LayerNorm(d)
        self.cross_attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, d))
        self.norm3 = nn.LayerNorm(d)

    def forward(self, tgt, query_pos, memory):
        q = tgt + query_pos
        tgt = self.norm1(tgt + self.self_attn(q, q, tgt)[0])
        tgt = self.norm2(tgt + self.cross_attn(tgt + query_pos, memory, memory)[0])
        return self.norm3(tgt + self.ffn(tgt))


class SetDetector(nn.Module):
    def __init__(self, d=64, queries=20, classes=6, layers=3):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 32, 4, 4), nn.ReLU(), nn.Conv2d(32, d, 2, 2))
        self.pos = nn.Parameter(torch.randn(64, d) * 0.1)
        self.encoder = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True)
        self.query_pos = nn.Embedding(queries, d)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(layers))
        self.classes, self.boxes = nn.Linear(d, classes + 1), nn.Linear(d, 4)

    def forward(self, x):
        memory = self.encoder(self.backbone(x).flatten(2).transpose(1, 2) + self.pos)
        query_pos = self.query_pos.weight.expand(x.shape[0], -1, -1)
        tgt, outputs = torch.zeros_like(query_pos), []
        for layer in self.layers:
            tgt = layer(tgt, query_pos, memory)
            outputs.append((self.classes(tgt), self.boxes(tgt).sigmoid()))
        return outputs


def train(db, pinned):
    torch.manual_seed(0)
    model = SetDetector()
    if pinned:
        ampdiag.pin_fp32(model.layers[0].self_attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_of(g):
        x = torch.randn(8, 3, 64, 64, generator=g)
        labels, boxes = torch.randint(0, 7, (8, 20), generator=g), torch.rand(8, 20, 4, generator=g)
        return sum(F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) + 5 * F.l1_loss(b.float(), boxes)
                   for logits, b in model(x))

    amp_training(db, model, opt, 30, loss_of)


def test_an_underflow_held_down_behind_a_norm_of_zero_queries_is_told_to_pin_the_self_attention(tmp_path, verdict):
    train(tmp_path / "run.db", pinned=False)
    code, rep = verdict(tmp_path / "run.db")
    assert code == 0  # warnings
    underflow = next(f for f in rep["findings"] if f["rule"] == "underflow")
    assert underflow["title"].endswith("no loss scale lifts it without layers.0.self_attn.out_proj.bias overflowing")
    first = underflow["suggestions"][0]
    assert first["summary"].startswith("Run layers.0.self_attn in FP32: layers.0.norm1, which takes its output, "
                                       "normalised an input with next to no spread")
    assert first["python"].startswith("ampdiag.pin_fp32(model.layers[0].self_attn)")
    for f in rep["findings"]:
        assert f["module"] != "layers.0.self_attn.out_proj", f["title"]
        assert all("out_proj)" not in s["python"] for s in f["suggestions"]), f["title"]


def test_the_same_detector_with_its_first_self_attention_pinned_is_healthy(tmp_path, verdict):
    train(tmp_path / "run.db", pinned=True)
    code, rep = verdict(tmp_path / "run.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
    assert rep["findings"] == [] or all(f["severity"] == "info" for f in rep["findings"])
