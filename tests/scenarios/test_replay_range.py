"""A module whose output overflows fp16 while its FP32 replay is finite but still beyond
fp16's range (a ViT block's mlp.fc1 with weights grown too large, as timm's ViT showed):
pinned alone it hands that FP32 output to the next fp16 operation, which overflows instead.
The report pins its parent, the block's MLP, and that pin trains the same loop healthy.
Where the code that uses the output runs in float32 (the last projection of a feed-forward
whose residual stream is float32, as T5's `wo`), the module pinned alone is enough, and the
report says which case is which rather than that it always overflows."""
from collections import OrderedDict

import torch
from torch import nn

import ampdiag
from conftest import amp_training, rows


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):  # pre-norm residual, as a ViT block's MLP half
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), Mlp()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def train(db, pin=None, hot="fc1", **options):
    """A ViT-like stack whose block.mlp.`hot` reaches ~2e5 in FP32 (weights ×1e5), fp16
    autocast, AdamW, a real GradScaler, 12 steps; `pin` the dotted path pinned to FP32;
    `options` for attach(). With hot="fc2" the stack has no embedding Linear: the block's
    residual stream is the float32 input, and fc2's output goes to that float32 sum."""
    torch.manual_seed(0)
    layers = OrderedDict(embed=nn.Linear(16, 16)) if hot == "fc1" else OrderedDict()
    layers.update(block=Block(), norm=nn.LayerNorm(16), head=nn.Linear(16, 4))
    model = nn.Sequential(layers)
    with torch.no_grad():
        model.block.mlp.get_submodule(hot).weight.mul_(1e5)
    if pin:
        ampdiag.pin_fp32(model.get_submodule(pin))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp_training(db, model, opt, 12, lambda g: nn.functional.cross_entropy(
        model(torch.randn(32, 16, generator=g)), torch.randint(0, 4, (32,), generator=g)), **options)


def test_a_module_whose_fp32_output_is_beyond_fp16_gets_its_parent_pinned(tmp_path, verdict):
    train(tmp_path / "hot.db")
    code, rep = verdict(tmp_path / "hot.db")
    assert code == 1
    fw = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert fw["module"] == "block.mlp.fc1" and fw["confirmation"] == "confirmed"
    assert "beyond fp16's largest value (65504)" in fw["evidence"]
    assert fw["suggestions"][0]["python"].startswith("ampdiag.pin_fp32(model.block.mlp)")


def test_the_parent_pin_says_when_the_module_alone_would_do(tmp_path, verdict):
    train(tmp_path / "hot.db")
    _, rep = verdict(tmp_path / "hot.db")
    fw = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    summary = fw["suggestions"][0]["summary"]
    assert "block.mlp.fc1 pinned alone hands its FP32 output, beyond fp16's range, to the code that uses it" in summary
    assert "enough where that code runs in float32" in summary and "an overflow there where it runs in fp16" in summary


def test_pinning_that_module_alone_moves_the_overflow_to_what_uses_its_output(tmp_path, verdict):
    train(tmp_path / "fc1.db", pin="block.mlp.fc1")
    code, rep = verdict(tmp_path / "fc1.db")
    assert code == 1
    fw = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert fw["module"] == "block.mlp.fc2"


def test_the_parent_pin_trains_the_same_loop_healthy(tmp_path, verdict):
    train(tmp_path / "mlp.db", pin="block.mlp")
    code, rep = verdict(tmp_path / "mlp.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]


def test_autopin_pins_that_parent_and_the_steps_after_it_fit(tmp_path, verdict):
    db = tmp_path / "autopin.db"
    train(db, autopin=True)
    assert rows(db, "SELECT step, detail FROM events WHERE kind = 'autopin'") == [(1, "block.mlp")]
    code, rep = verdict(db)
    pinned = next(f for f in rep["findings"] if f["rule"] == "autopin")
    assert pinned["title"] == "auto-pinned block.mlp to FP32 at step 1; after it, 0 skips"
    assert pinned["evidence"].startswith("it holds block.mlp.fc1, FP32 output up to ")


def test_a_module_whose_output_goes_to_a_float32_residual_sum_gets_its_parent_pinned_too(tmp_path, verdict):
    train(tmp_path / "wo.db", hot="fc2")
    code, rep = verdict(tmp_path / "wo.db")
    assert code == 1
    fw = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert fw["module"] == "block.mlp.fc2" and fw["confirmation"] == "confirmed"
    assert fw["suggestions"][0]["python"].startswith("ampdiag.pin_fp32(model.block.mlp)")


def test_that_module_pinned_alone_trains_healthy_when_its_output_goes_to_a_float32_sum(tmp_path, verdict):
    train(tmp_path / "wo_pinned.db", pin="block.mlp.fc2", hot="fc2")
    code, rep = verdict(tmp_path / "wo_pinned.db")
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]


class Adapted(nn.Module):
    """PEFT's LoRA Linear in miniature: its adapters sit in ModuleDicts that it calls into."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(16, 4)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, 16)})

    def forward(self, x):
        return self.base(x) + self.lora_B["default"](self.lora_A["default"](x))


def test_autopin_pins_the_module_that_calls_into_a_module_dict_not_the_dict(tmp_path, verdict):
    # lora_B.default's FP32 output is beyond fp16's range; its parent lora_B has no forward
    # to pin, so the LoRA Linear that calls it is pinned, and the report says the same.
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(16, 16), adapted=Adapted(), norm=nn.LayerNorm(16),
                                      head=nn.Linear(16, 4)))
    with torch.no_grad():
        model.adapted.lora_B["default"].weight.mul_(1e5)
    db = tmp_path / "lora.db"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp_training(db, model, opt, 12, lambda g: nn.functional.cross_entropy(
        model(torch.randn(32, 16, generator=g)), torch.randint(0, 4, (32,), generator=g)), autopin=True)
    assert rows(db, "SELECT step, detail FROM events WHERE kind = 'autopin'") == [(1, "adapted")]
    _, rep = verdict(db)
    fw = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert fw["module"] == "adapted.lora_B.default"
    assert fw["suggestions"][0]["summary"].startswith("Run adapted in FP32, adapted.lora_B.default with what uses")
