"""A module's own code after its submodules (event "module-code") as the first fix of a
confirmed forward overflow.

A graph convolution that sums its messages with index_add_: on a graph whose ten hub nodes
receive most of the edges, a hub's fp16 sum passes 65504 whatever the weights. The report
names the layer, the IndexAdd its own code runs after its Linear, and dividing that sum by
the node's degree as the first fix; so divided, the same loop is healthy.

A normalizing flow's affine coupling layers, `x2 * exp(s) + t`, with no tanh on the
log-scale `s`, trained by maximum likelihood on data four times the unit scale: a coupling's
exp() passes fp16's range, and in FP32 its output reaches billions. The report bounds the
exponent first; bounded with tanh, no module's output goes NaN/Inf in forward.

LoRA adapters whose scaling, alpha / r, was set to 50000 (alpha 400000 for r 8): each
adapted projection multiplies its adapter's output by it, and its FP32 output passes fp16's
range. The report names the constant first; at PEFT's usual scaling of 2 the loop trains."""
import math

import torch
from torch import nn

from conftest import amp_training, rows

NODES, EDGES = 3000, 40000


def graph():
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, NODES, (EDGES,), generator=g)
    hub = torch.rand(EDGES, generator=g) < 0.6
    dst = torch.where(hub, torch.randint(0, 10, (EDGES,), generator=g), torch.randint(0, NODES, (EDGES,), generator=g))
    return src, dst, torch.zeros(NODES).index_add_(0, dst, torch.ones(EDGES)).clamp(min=1)


class SumConv(nn.Module):
    def __init__(self, n_in, n_out, edges, mean):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.src, self.dst, self.deg = edges
        self.mean = mean

    def forward(self, x):
        messages = self.lin(x)[self.src]
        out = torch.zeros(NODES, messages.shape[1], dtype=messages.dtype).index_add_(0, self.dst, messages)
        return out / self.deg.unsqueeze(1).to(out.dtype) if self.mean else out


class GraphNet(nn.Module):
    def __init__(self, mean=False):
        super().__init__()
        edges = graph()
        self.c1, self.c2 = SumConv(16, 64, edges, mean), SumConv(64, 64, edges, mean)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.relu(self.c2(torch.relu(self.c1(x)))))


def train(db, mean):
    torch.manual_seed(0)
    model = GraphNet(mean)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(NODES, 16, generator=g) * 40, torch.randint(0, 4, (NODES,), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp_training(db, model, opt, 8, lambda _: nn.functional.cross_entropy(model(x).float(), y))


def test_a_graph_layers_sum_over_hub_nodes_is_named_by_its_index_add(tmp_path, verdict):
    db = tmp_path / "sum.db"
    train(db, mean=False)
    assert rows(db, "SELECT detail FROM events WHERE kind = 'module-code'") == [("c2: Index:float16, IndexAdd:float16",)]
    code, report = verdict(db)
    assert code == 1
    top = report["findings"][0]
    assert (top["rule"], top["module"]) == ("forward-nonfinite", "c2"), report["findings"]
    assert "IndexAdd" in top["evidence"]
    assert top["suggestions"][0]["summary"].startswith("Divide the sum in c2's own code (IndexAdd) by its number of terms")


def test_the_graph_layer_averaged_over_its_degree_trains_healthy(tmp_path, verdict):
    db = tmp_path / "mean.db"
    train(db, mean=True)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]


class Coupling(nn.Module):
    def __init__(self, flip, bounded):
        super().__init__()
        self.flip, self.bounded = flip, bounded
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x):
        x1, x2 = x.chunk(2, -1)
        if self.flip:
            x1, x2 = x2, x1
        s, t = self.net(x1).chunk(2, -1)
        if self.bounded:
            s = torch.tanh(s)
        y2 = x2 * torch.exp(s) + t
        return torch.cat([y2, x1] if self.flip else [x1, y2], -1), s.sum(-1)


class Flow(nn.Module):
    def __init__(self, bounded):
        super().__init__()
        self.layers = nn.ModuleList(Coupling(i % 2 == 1, bounded) for i in range(6))

    def forward(self, x):
        logdet = 0
        for layer in self.layers:
            x, step_logdet = layer(x)
            logdet = logdet + step_logdet
        return x, logdet


def train_flow(db, bounded):
    torch.manual_seed(0)
    model = Flow(bounded)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def nll(g):
        x = torch.randn(128, 16, generator=g) * torch.linspace(0.5, 3, 16) * 4
        z, logdet = model(x)
        return (0.5 * (z.float() ** 2).sum(-1) + 8 * math.log(2 * math.pi) - logdet.float()).mean()

    amp_training(db, model, opt, 12, nll)


def test_a_couplings_unbounded_exp_is_bounded_first(tmp_path, verdict):
    db = tmp_path / "flow.db"
    train_flow(db, bounded=False)
    code, report = verdict(db)
    assert code == 1
    top = report["findings"][0]
    assert top["rule"] == "forward-nonfinite" and top["module"].startswith("layers."), report["findings"]
    assert "Exp (float16)" in top["evidence"]
    module = top["module"]
    assert top["suggestions"][0]["summary"].startswith(f"Bound what {module}'s own code passes to exp() (Exp)")


def test_the_coupling_with_its_log_scale_bounded_stays_finite_in_forward(tmp_path, verdict):
    db = tmp_path / "bounded.db"
    train_flow(db, bounded=True)
    _, report = verdict(db)
    assert not [f for f in report["findings"] if f["rule"] == "forward-nonfinite"], report["findings"]


class LoraLinear(nn.Module):
    """A frozen Linear plus a trained low-rank adapter scaled by alpha / r, as PEFT's."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base, self.scaling = base, alpha / r
        self.lora_A, self.lora_B = nn.Linear(base.in_features, r, bias=False), nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # as after a few steps (PEFT starts it at 0)
        base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def train_lora(db, alpha):
    torch.manual_seed(0)
    model = nn.Sequential(LoraLinear(nn.Linear(64, 128), 8, alpha), nn.GELU(), LoraLinear(nn.Linear(128, 10), 8, alpha))
    params = [p for p in model.parameters() if p.requires_grad]
    amp_training(db, model, torch.optim.AdamW(params, lr=1e-3), 8, lambda g: nn.functional.cross_entropy(
        model(torch.randn(32, 64, generator=g)).float(), torch.randint(0, 10, (32,), generator=g)))


def test_a_lora_scaling_far_too_large_is_brought_down_first(tmp_path, verdict):
    db = tmp_path / "lora.db"
    train_lora(db, alpha=400000.0)
    code, report = verdict(db)
    assert code == 1
    fw = next(f for f in report["findings"] if f["rule"] == "forward-nonfinite")
    assert fw["module"] == "2", fw["module"]
    assert fw["suggestions"][0]["summary"].startswith(
        "Bring down the constant 2's own code multiplies by: the multiplication by 50000 (Mul) multiplies its input "
        "by 50000"), fw["suggestions"][0]["summary"]


def test_the_lora_scaling_peft_uses_trains_healthy(tmp_path, verdict):
    db = tmp_path / "lora.db"
    train_lora(db, alpha=16.0)
    code, report = verdict(db)
    assert (code, report["healthy"]) == (0, True), report["findings"]
