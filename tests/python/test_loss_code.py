"""The loss code: the operations between the model's outputs and the loss, read from
autograd's graph ("Name:dtype", forward order, only what lies on a path from an output to
the loss), and written as event "loss-code" in a step whose loss, or the gradient reaching
the output, went NaN/Inf while no module's output did; before backward, what the loss was
given (a target) is looked at too (event "loss-input-nonfinite")."""
import sqlite3
import warnings
import weakref

import pytest
import torch
from torch import nn

import ampdiag
from ampdiag._loss_code import loss_code, nonfinite_constants, path_nodes, with_numbers


def test_the_operations_from_the_output_to_the_loss_come_in_forward_order_with_their_dtypes():
    x = torch.randn(4, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        out = x @ torch.randn(3, 5)
        loss = out.float().log_softmax(-1).mean()
    assert loss_code(path_nodes([loss.grad_fn], [out.grad_fn])) == "ToCopy:float32, LogSoftmax:float32, Mean:float32"


def test_an_operation_left_in_float16_says_so():
    out = torch.randn(4, 3, requires_grad=True).half() * 2
    loss = out.sum().float()
    assert loss_code(path_nodes([loss.grad_fn], [out.grad_fn])) == "Sum:float16, ToCopy:float32"


def test_a_regulariser_over_the_parameters_is_not_part_of_the_loss_code():
    model = nn.Linear(3, 2)
    out = model(torch.randn(4, 3))
    loss = out.pow(2).mean() + sum(p.pow(2).sum() for p in model.parameters()) * 1e-4
    assert loss_code(path_nodes([loss.grad_fn], [out.grad_fn])) == "Pow(2):float32, Mean:float32, Add:float32"


class _Node:
    """A node of a made-up graph (what autograd keeps in C++)."""

    def __init__(self, name, *children):
        self.name_, self.children = name, children


class _NodeObject:
    """What Python sees of a _Node, made as torch makes grad_fn objects: the same object
    while one is alive, a new one after it is freed, maybe at the freed one's address."""
    __slots__ = ("node", "__weakref__")
    _alive = weakref.WeakValueDictionary()

    def __new__(cls, node):
        obj = cls._alive.get(id(node))
        if obj is None:
            obj = object.__new__(cls)
            obj.node = node
            cls._alive[id(node)] = obj
        return obj

    def name(self):
        return self.node.name_

    @property
    def next_functions(self):
        return tuple((_NodeObject(child), 0) for child in self.node.children)


def test_the_walk_holds_its_nodes_so_a_freed_node_objects_id_is_not_taken_for_another():
    # The regulariser's graph: its branches' node objects are freed as the walk passes
    # them; a new object reusing a freed one's id had cut the path to the output (seen on
    # Python 3.12 with torch's own nodes).
    output = _Node("AddmmBackward0", _Node("AccumulateGrad"), _Node("TBackward0", _Node("AccumulateGrad")))

    def branch():
        return _Node("SumBackward0", _Node("PowBackward0", _Node("AccumulateGrad")))

    regulariser = _Node("MulBackward0", _Node("AddBackward0", _Node("AddBackward0", branch(), branch()), branch()))
    loss = _Node("AddBackward0", _Node("MeanBackward0", _Node("PowBackward0", output)), regulariser)
    out = _NodeObject(output)
    assert [n.name() for n in path_nodes([_NodeObject(loss)], [out])] == ["PowBackward0", "MeanBackward0",
                                                                         "AddBackward0"]


def test_a_power_carries_its_exponent_and_a_sqrt_is_named():
    out = torch.randn(4, 3, requires_grad=True) * 1
    loss = (out ** 0.5).sqrt().sum()
    assert loss_code(path_nodes([loss.grad_fn], [out.grad_fn])) == "Pow(0.5):float32, Sqrt:float32, Sum:float32"


def test_a_division_or_a_product_by_a_number_carries_it_and_one_by_a_tensor_does_not():
    out = torch.randn(4, 3, requires_grad=True) * 1
    loss = ((out / 0.07) * 1e4 / out.detach().abs().add(1)).sum()
    assert loss_code(path_nodes([loss.grad_fn], [out.grad_fn])) == "Div(0.07):float32, Mul(10000):float32, Div:float32, " \
                                                                   "Sum:float32"


def test_a_learnt_scale_is_read_without_a_warning():
    out = torch.randn(4, 3, requires_grad=True) * 1
    logit_scale = torch.tensor(2.0, requires_grad=True)
    loss = (out * logit_scale.exp()).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float() of a tensor that requires grad warns
        code = loss_code(path_nodes([loss.grad_fn], [out.grad_fn]))
    assert code.startswith("Mul(7.38906):float32")


def nll_name(loss, out):
    return next(op for op in loss_code(path_nodes([loss.grad_fn], [out.grad_fn])).split(", ") if "NllLoss" in op)


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_nll_loss_says_a_reduction_that_cannot_divide_by_zero(reduction):
    out = torch.randn(4, 3, requires_grad=True) * 1
    loss = nn.functional.cross_entropy(out, torch.tensor([0, 1, 2, 1]), reduction=reduction).sum()
    assert nll_name(loss, out) == f"NllLoss({reduction}):float32"


def test_nll_loss_with_a_mean_says_the_total_weight_it_divides_by_before_backward():
    out = torch.randn(4, 3, requires_grad=True) * 1
    kept = nn.functional.cross_entropy(out, torch.tensor([0, -100, 2, 1]))
    ignored = nn.functional.cross_entropy(out, torch.full((4,), -100))
    assert nll_name(kept, out) == "NllLoss(mean of 3):float32"
    assert nll_name(ignored, out) == "NllLoss(mean of 0):float32"
    kept.backward()  # frees the total weight: the reduction alone is left to say
    assert nll_name(kept, out) == "NllLoss(mean):float32"


def test_nll_loss_over_an_image_is_named_as_torch_names_it():
    out = torch.randn(2, 3, 4, 4, requires_grad=True) * 1
    loss = nn.functional.cross_entropy(out, torch.zeros(2, 4, 4, dtype=torch.long))
    assert nll_name(loss, out) == "NllLoss2D(mean of 32):float32"


def test_a_loss_the_model_returns_alone_has_no_loss_code():
    out = (torch.randn(4, 3, requires_grad=True) * 2).sum()
    assert loss_code(path_nodes([out.grad_fn], [out.grad_fn])) is None


def test_a_loss_the_model_returns_with_its_logits_has_the_code_between_them():
    logits = torch.randn(4, 3, requires_grad=True) * 2
    loss = -logits.softmax(-1).log().mean()  # Hugging Face style: computed inside forward
    assert loss_code(path_nodes([loss.grad_fn], [loss.grad_fn, logits.grad_fn])) == \
        "Softmax:float32, Log:float32, Mean:float32, Neg:float32"


def test_a_loss_that_does_not_reach_the_outputs_has_no_loss_code():
    out = torch.randn(4, 3, requires_grad=True) * 2
    other = (torch.randn(2, requires_grad=True) * 3).sum()
    assert loss_code(path_nodes([other.grad_fn], [out.grad_fn])) is None


def test_the_graph_is_read_after_backward_freed_its_tensors():
    out = torch.randn(4, 3, requires_grad=True) * 1
    loss = (out ** 0.5).sum()
    loss.backward()
    assert loss_code(path_nodes([loss.grad_fn], [out.grad_fn])) == "Pow(0.5):float32, Sum:float32"


def loss_code_events(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT step, detail FROM events WHERE kind = 'loss-code' ORDER BY id").fetchall()


def train(db, loss_of, steps=4, first=None, inputs=torch.randn):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if first is not None:
        first(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for step in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(inputs(6, 8))
            scaler.scale(loss_of(step, out)).backward()
            scaler.step(opt)
            scaler.update()


def test_the_agent_writes_the_loss_code_once_in_each_step_whose_loss_went_nan(tmp_path):
    db = tmp_path / "run.db"
    train(db, lambda step, out: -torch.log(out.float().softmax(-1) * (step != 2)).mean())
    assert loss_code_events(db) == [(2, "ToCopy:float32, Softmax:float32, Mul(0):float32, Log:float32, Mean:float32, "
                                        "Neg:float32")]


def test_the_agent_writes_the_loss_code_when_the_losss_backward_made_nan(tmp_path):
    db = tmp_path / "run.db"
    train(db, lambda step, out: ((out.float()[:, None] - out.float()[None]) ** 2).sum(-1).sqrt().mean(), steps=1)
    [(step, code)] = loss_code_events(db)
    assert step == 0 and "Pow(2):float32, Sum:float32, Sqrt:float32, Mean:float32" in code


def test_no_loss_code_is_read_where_a_module_made_the_nan(tmp_path):
    db = tmp_path / "run.db"

    def poison(model):  # the first layer's output overflows fp16: 8 inputs x 1e4 > 65504
        with torch.no_grad():
            model[0].weight.fill_(1e4)

    train(db, lambda step, out: out.float().mean(), steps=2, first=poison, inputs=torch.ones)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM steps WHERE skipped = 1").fetchone() == (2,)
    assert loss_code_events(db) == []


def test_a_factor_on_the_loss_whose_gradient_overflowed_at_the_output_is_written_with_its_number(tmp_path):
    # The look runs in backward, after the product's saved number was freed: the number comes
    # from the loss code read as the first backward was about to start.
    db = tmp_path / "run.db"
    train(db, lambda step, out: nn.functional.cross_entropy(out.float(), torch.zeros(6, dtype=torch.long)) * 1e6,
          steps=1)
    assert loss_code_events(db) == [(0, "ToCopy:float32, LogSoftmax:float32, NllLoss(mean):float32, "
                                        "Mul(1e+06):float32")]


def test_numbers_read_before_are_taken_only_for_the_same_operations_and_only_a_products_or_divisions():
    before = "ToCopy:float32, NllLoss(mean of 64):float32, Mul(1e+06):float32"
    assert with_numbers("ToCopy:float32, NllLoss(mean):float32, Mul:float32", before) == (
        "ToCopy:float32, NllLoss(mean):float32, Mul(1e+06):float32")  # a count is that batch's alone
    assert with_numbers("ToCopy:float32, MseLoss(mean):float32, Mul:float32", before) == (
        "ToCopy:float32, MseLoss(mean):float32, Mul:float32")
    assert with_numbers("ToCopy:float32, NllLoss(mean):float32, Mul:float16", before) == (
        "ToCopy:float32, NllLoss(mean):float32, Mul:float16")
    assert with_numbers("ToCopy:float32, NllLoss(mean of 0):float32, Mul(0):float32", before) == (
        "ToCopy:float32, NllLoss(mean of 0):float32, Mul(0):float32")


def test_a_healthy_run_reads_no_loss_code(tmp_path):
    db = tmp_path / "run.db"
    train(db, lambda step, out: out.float().pow(2).mean())
    assert loss_code_events(db) == []


def test_the_first_loss_code_is_written_once_a_run_with_its_numbers(tmp_path):
    # What a run whose gradients are too large for the scale, its loss finite, has to tell a
    # loss over class indices or a factor on it by.
    db = tmp_path / "run.db"
    train(db, lambda step, out: nn.functional.cross_entropy(out.float(), torch.zeros(6, dtype=torch.long)) * 16)
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT step, detail FROM events WHERE kind = 'loss-code-first'").fetchall()
    assert rows == [(0, "ToCopy:float32, LogSoftmax:float32, NllLoss(mean of 6):float32, Mul(16):float32")]


def test_a_nan_target_the_loss_saved_is_named_with_its_counts_and_dtype():
    out = torch.randn(4, 1, requires_grad=True) * 1
    target = torch.ones(4, 1)
    target[2] = float("nan")
    loss = nn.functional.mse_loss(out, target)
    assert nonfinite_constants(path_nodes([loss.grad_fn], [out.grad_fn])) == "MseLoss target: 1 NaN, 0 Inf of 4 values, float32"


def test_a_float32_target_holding_only_float16_values_is_said_to_hold_them():
    # A Gram matrix overflowed in float16, then cast to float32 as autocast does for mse_loss.
    out = torch.randn(64, 1, requires_grad=True) * 1
    target = (torch.randn(64, 1) * 3).half().float()
    target[5] = float("inf")
    loss = nn.functional.mse_loss(out, target)
    assert nonfinite_constants(path_nodes([loss.grad_fn], [out.grad_fn])) == \
        "MseLoss target: 0 NaN, 1 Inf of 64 values, float32 (float16 values)"


def test_a_float32_target_of_whole_numbers_is_not_said_to_hold_half_values():
    # Class indices or counts fit float16 exactly without ever having been float16.
    out = torch.randn(64, 1, requires_grad=True) * 1
    target = torch.randint(0, 5, (64, 1)).float()
    target[5] = float("nan")
    loss = nn.functional.mse_loss(out, target)
    assert nonfinite_constants(path_nodes([loss.grad_fn], [out.grad_fn])) == \
        "MseLoss target: 1 NaN, 0 Inf of 64 values, float32"


def test_nan_the_model_made_is_no_constant_of_the_loss_code():
    out = torch.tensor([[1.0], [float("nan")]], requires_grad=True) * 1
    loss = (out * 2).sum()
    assert nonfinite_constants(path_nodes([loss.grad_fn], [out.grad_fn])) is None


def test_after_backward_the_saved_tensors_are_gone_and_nothing_is_named():
    out = torch.randn(4, 1, requires_grad=True) * 1
    loss = nn.functional.mse_loss(out, torch.full((4, 1), float("nan")))
    nodes = path_nodes([loss.grad_fn], [out.grad_fn])
    loss.backward()
    assert nonfinite_constants(nodes) is None


def test_the_agent_names_a_nan_regression_target_before_backward(tmp_path):
    db = tmp_path / "run.db"

    def loss_of(step, out):
        y = torch.zeros(6, 4)
        if step == 1:
            y[3, 0] = float("nan")
        return nn.functional.mse_loss(out.float(), y)

    train(db, loss_of, steps=3)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT step, detail FROM events WHERE kind = 'loss-input-nonfinite'").fetchall() == \
            [(1, "MseLoss target: 1 NaN, 0 Inf of 24 values, float32")]


def test_an_operations_own_saved_results_are_not_what_it_was_given():
    # CTC saves its log-alphas, -inf where no alignment reaches: made by it, not given to it.
    logp = torch.randn(10, 2, 5, requires_grad=True).log_softmax(-1)
    targets = torch.randint(1, 5, (2, 30))
    loss = nn.functional.ctc_loss(logp, targets, torch.full((2,), 10), torch.full((2,), 30))
    assert not torch.isfinite(loss)
    assert nonfinite_constants(path_nodes([loss.grad_fn], [logp.grad_fn])) is None


class ReturnsItsLoss(nn.Module):
    """As Hugging Face's models given labels: (loss, logits), the loss computed in forward()."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x, labels):
        logits = self.net(x)
        return nn.functional.cross_entropy(logits.float(), labels), logits


def test_the_loss_code_of_a_model_returning_its_loss_runs_from_its_logits_through_that_loss(tmp_path):
    # Divided by the accumulation steps in the loop: the loss scaled is not the model's own,
    # and the walk from it had stopped at that output, the code read "Div(2)" alone.
    torch.manual_seed(0)
    model, db = ReturnsItsLoss(), tmp_path / "run.db"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss, _ = model(torch.randn(6, 8), torch.zeros(6, dtype=torch.long))
        scaler.scale(loss / 2).backward()
        scaler.step(opt)
        scaler.update()
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT detail FROM events WHERE kind = 'loss-code-first'").fetchall()
    assert rows == [("ToCopy:float32, LogSoftmax:float32, NllLoss(mean of 6):float32, Div(2):float32",)]
