"""Which parameters count as holding NaN/Inf when a step goes NaN/Inf, which optimizer eps
is 0 in the parameters' dtype (the agent's evidence for nonfinite-update), which of a
module's buffers hold NaN (or an Inf training wrote) where its FP32 replay made NaN from
finite inputs, and when the parameters are not read at all."""
import torch
from torch import nn

import ampdiag
import ampdiag._looks
from ampdiag._parameters import eps_rounding_to_zero, finite_buffers, nan_buffers, nonfinite_parameters


def test_a_trainable_parameter_holding_inf_is_named_with_the_count():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight[0, 2] = float("inf")
    assert nonfinite_parameters(model.named_parameters()) == "1 of 4 parameter tensors: 1.weight"


def test_a_frozen_minus_inf_mask_kept_as_a_parameter_is_by_design():
    mask = nn.Parameter(torch.full((4, 4), float("-inf")).triu(1), requires_grad=False)
    assert nonfinite_parameters([("mask", mask)]) is None


def test_a_frozen_parameter_holding_nan_is_named():
    frozen = nn.Parameter(torch.tensor([1.0, float("nan")]), requires_grad=False)
    assert nonfinite_parameters([("frozen", frozen)]) == "1 of 1 parameter tensors: frozen"


def test_adapted_weights_functional_call_puts_in_the_parameters_place_are_not_read():
    # MAML's inner step: torch.func.functional_call swaps computed tensors in for the call,
    # and an Inf inner gradient makes them NaN, while the stored parameters stay finite.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    adapted = {name: p - float("inf") * torch.ones_like(p) for name, p in model.named_parameters()}
    seen = []
    model[1].register_forward_hook(lambda *_: seen.append(nonfinite_parameters(model.named_parameters())))
    torch.func.functional_call(model, adapted, (torch.ones(2, 4),))
    assert seen == [None]


def test_past_five_names_the_rest_are_counted():
    named = [(f"p{i}", nn.Parameter(torch.tensor([float("nan")]))) for i in range(7)]
    assert nonfinite_parameters(named) == "7 of 7 parameter tensors: p0, p1, p2, p3, p4 (+2 more)"


def test_adams_default_eps_is_zero_in_float16_and_not_in_bfloat16():
    half = torch.optim.Adam([nn.Parameter(torch.zeros(2, dtype=torch.float16))])
    bf16 = torch.optim.Adam([nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    assert eps_rounding_to_zero([half]) == "Adam eps=1e-08 is 0 in float16"
    assert eps_rounding_to_zero([bf16]) is None


def test_an_eps_float16_holds_and_an_optimizer_without_eps_say_nothing():
    p = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    assert eps_rounding_to_zero([torch.optim.Adam([p], eps=1e-4), torch.optim.SGD([p], lr=0.1)]) is None


def test_a_batchnorms_nan_running_variance_is_named_with_its_count():
    bn = nn.BatchNorm2d(8)
    bn.running_var[3] = float("nan")
    assert nan_buffers("backbone.1", bn) == "backbone.1: running_var (1 of 8 values NaN)"


def test_a_minus_inf_mask_buffer_is_by_design_and_a_clean_module_has_none():
    attn = nn.Module()
    attn.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
    assert nan_buffers("attn", attn) is None
    assert nan_buffers("bn", nn.BatchNorm1d(4)) is None


def test_an_inf_in_a_buffer_finite_at_attach_is_named_and_a_mask_present_then_is_not():
    vq = nn.Module()
    vq.register_buffer("codebook", torch.zeros(4, 8))
    vq.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
    at_attach = finite_buffers(vq)
    assert at_attach == {(id(vq), "codebook")}
    vq.codebook[1, :3] = float("inf")  # an EMA update that overflowed float16
    vq.mask[0, 0] = float("inf")
    assert nan_buffers("vq", vq, at_attach) == "vq: codebook (float32: 3 of 32 values Inf, finite at attach())"
    assert nan_buffers("vq", vq) is None  # without what attach() saw, an Inf may be a mask
    vq.mask.fill_(0.0)[0, 1] = float("-inf")  # a per-batch mask kept in a buffer
    assert nan_buffers("vq", vq, finite_buffers(vq)) is None
    vq.codebook[2, 0] = float("nan")
    assert nan_buffers("vq", vq, at_attach) == "vq: codebook (float32: 1 NaN and 3 Inf of 32 values, finite at attach())"


def test_a_submodules_buffers_are_its_own_to_name():
    block = nn.Sequential(nn.BatchNorm1d(4))
    block[0].running_mean[0] = float("nan")
    assert nan_buffers("block", block) is None
    assert nan_buffers("block.0", block[0]) == "block.0: running_mean (1 of 4 values NaN)"


def test_a_module_known_to_mask_with_minus_inf_does_not_have_the_parameters_read_every_step(tmp_path, monkeypatch):
    # Its -inf says nothing of the parameters: reading them all again each step of a masked
    # model cost a pass over every parameter a step.
    reads = []
    real = ampdiag._looks.nonfinite_parameters
    monkeypatch.setattr(ampdiag._looks, "nonfinite_parameters", lambda named: reads.append(1) or real(named))

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(x).masked_fill(torch.tensor([False, True, False, False]), float("-inf"))

    torch.manual_seed(0)
    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db"):
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(torch.randn(6, 8)).float(), torch.zeros(6, dtype=torch.long))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert len(reads) == 1
