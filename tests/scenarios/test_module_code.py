"""A graph convolution that sums its messages with index_add_: on a graph whose ten hub nodes
receive most of the edges, a hub's fp16 sum passes 65504 whatever the weights. The report
names the layer, the IndexAdd its own code runs after its Linear (event "module-code"), and
dividing that sum by the node's degree as the first fix; so divided, the same loop is
healthy."""
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
