"""The precision checks (attach(precision_budget=...)): one module per step, its call as it
ran under fp16 autocast compared with the same call in FP32 on copies of its inputs, state
and RNG; rows in precision_checks. They change nothing the training computes."""
import random
import sqlite3

import numpy as np
import pytest
import torch
from torch import nn

import ampdiag
from ampdiag._precision import VERIFY_FROM


class RMSNorm(nn.Module):
    """Written by hand, as model code often is: in fp16, x * x of an activation above 256
    overflows, rsqrt(Inf) is 0, and the row comes out exactly 0 (x * x, not x.pow(2), which
    CUDA's autocast runs in FP32)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)


class Net(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(16, 64), norm, nn.Linear(64, 1)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


def train(db, norm, steps=12, batch_scale=1.0, autocast=True, autocast_from=0, **options):
    """`steps` fp16-autocast AMP steps of Net(norm) with a real GradScaler under attach()
    (autocast from step `autocast_from` on); returns the model's parameters after training
    and the RNG's next draw."""
    torch.manual_seed(0)
    model = Net(norm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    handle = ampdiag.attach(model, scaler, db=str(db), **options) if db is not None else None
    for step in range(steps):
        x = torch.randn(32, 16, generator=g) * batch_scale
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast and step >= autocast_from):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    if handle is not None:
        handle.close()
    return [p.detach().clone() for p in model.parameters()], torch.rand(1)


def checks(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT step, module, dtype, numel, rel_error, zeroed, fp32_absmax FROM precision_checks "
                         "ORDER BY id").fetchall()


def test_a_norm_whose_square_overflows_fp16_is_checked_far_from_fp32(tmp_path):
    train(tmp_path / "run.db", RMSNorm(64), batch_scale=300.0, precision_budget=1.0)
    norm = [c for c in checks(tmp_path / "run.db") if c[1] == "norm"]
    assert norm, checks(tmp_path / "run.db")
    for step, _, dtype, numel, error, zeroed, absmax in norm:
        assert dtype == "float32"  # the fp32 weight times fp16 activations
        assert numel == 32 * 64 and error > 0.9 and zeroed > numel // 2 and absmax > 1.0


def test_modules_that_fit_fp16_are_checked_within_rounding(tmp_path):
    train(tmp_path / "run.db", nn.LayerNorm(64), precision_budget=1.0)
    found = checks(tmp_path / "run.db")
    assert {c[1] for c in found} == {"inp", "norm", "out"}
    assert all(c[4] < 1e-2 and c[5] == 0 for c in found), found


def test_one_module_is_checked_per_step_in_turn(tmp_path):
    train(tmp_path / "run.db", nn.LayerNorm(64), steps=6, precision_budget=1.0)
    assert [(c[0], c[1]) for c in checks(tmp_path / "run.db")] == [
        (0, "inp"), (1, "norm"), (2, "out"), (3, "inp"), (4, "norm"), (5, "out")]


def test_a_dropout_is_replayed_with_the_masks_it_drew(tmp_path):
    norm = nn.Sequential(nn.Dropout(0.5), nn.LayerNorm(64))
    train(tmp_path / "run.db", norm, steps=8, precision_budget=1.0)
    dropout = [c for c in checks(tmp_path / "run.db") if c[1] == "norm.0"]
    assert dropout and all(c[4] < 1e-2 for c in dropout), dropout  # other masks would be ~100 % away


class HostRandomMask(nn.Module):
    """Masks time steps with numpy's and Python's global generators, as HF's Wav2Vec2
    masks its features with numpy's: a copy must draw the same."""

    def forward(self, x):
        keep = torch.from_numpy(np.random.rand(x.shape[-1]) > 0.3).to(x.dtype)
        return x * keep * (1.0 + random.random())


def seeded_hosts():
    np.random.seed(0)
    random.seed(0)


def test_a_mask_drawn_from_numpy_and_python_is_replayed_with_the_same_draws(tmp_path):
    seeded_hosts()
    train(tmp_path / "run.db", nn.Sequential(HostRandomMask(), nn.LayerNorm(64)), steps=8, precision_budget=1.0)
    masked = [c for c in checks(tmp_path / "run.db") if c[1] == "norm.0"]
    assert masked and all(c[4] < 1e-2 for c in masked), masked  # other draws would be far away


NOISE = torch.Generator().manual_seed(0)  # a generator of the model's code, out of ampdiag's reach


class OwnGeneratorNoise(nn.Module):
    def forward(self, x):
        return x + torch.randn(x.shape, generator=NOISE).to(x.dtype)


def test_a_call_drawing_from_a_generator_of_its_own_is_not_compared_and_says_why(tmp_path):
    train(tmp_path / "run.db", nn.Sequential(OwnGeneratorNoise(), nn.LayerNorm(64)), steps=8, precision_budget=1.0)
    # norm.0 draws, and norm (the Sequential holding it) with it: other draws, not fp16's doing
    assert {c[1] for c in checks(tmp_path / "run.db")} == {"inp", "norm.1", "out"}
    with sqlite3.connect(tmp_path / "run.db") as c:
        said = dict(d.split(": ", 1) for (d,) in c.execute(
            "SELECT detail FROM events WHERE kind = 'precision-check-unreproducible'").fetchall())
    assert sorted(said) == ["norm", "norm.0"]
    assert said["norm.0"].startswith("run again as it ran")


class HalfDrawnMask(nn.Module):
    """A mask drawn from a probability tensor in bfloat16 where the call runs in reduced
    precision: CPU's torch.bernoulli maps a bfloat16 tensor's draws to other elements than a
    float32 one's, from the same generator state (as a bf16 run's mask drawn in the
    activation's dtype would be)."""

    def forward(self, x):
        keep = torch.full_like(x, 0.9, dtype=torch.float32 if x.dtype == torch.float32 else torch.bfloat16)
        return x * torch.bernoulli(keep).to(x.dtype) / 0.9


def test_a_call_whose_draws_depend_on_the_dtype_is_not_compared_and_says_why(tmp_path):
    train(tmp_path / "run.db", nn.Sequential(HalfDrawnMask(), nn.LayerNorm(64)), steps=8, precision_budget=1.0)
    found = checks(tmp_path / "run.db")
    assert "norm.0" not in {c[1] for c in found} and all(c[4] < VERIFY_FROM for c in found), found
    with sqlite3.connect(tmp_path / "run.db") as c:
        said = dict(d.split(": ", 1) for (d,) in c.execute(
            "SELECT detail FROM events WHERE kind = 'precision-check-unreproducible'").fetchall())
    assert said["norm.0"].startswith("its call draws random numbers, and other draws move its FP32 output")


class NearTiedSwitch(nn.Module):
    """A top-1 switch between two paths whose router rows differ by 1e-4: float16 rounds their
    logits to ties (argmax then takes the first), float32 tells them apart, so whole rows
    take the other path in FP32, with nothing lost to rounding in either."""

    def __init__(self, d):
        super().__init__()
        self.router = nn.Linear(d, 2, bias=False)
        with torch.no_grad():
            self.router.weight[1] = self.router.weight[0] + 1e-4 * torch.randn(d)

    def forward(self, x):
        return torch.where(self.router(x).argmax(-1, keepdim=True) == 0, x, -x)


def test_a_decision_that_flips_between_the_precisions_is_not_compared_and_says_why(tmp_path):
    # A top-1 mixture of experts routed a near-tied token to another expert in FP32: the
    # check called its output "29 % away from FP32", a precision-loss warning on a healthy run.
    train(tmp_path / "run.db", nn.Sequential(NearTiedSwitch(64), nn.LayerNorm(64)), steps=6, precision_budget=1.0)
    assert all(c[4] < VERIFY_FROM for c in checks(tmp_path / "run.db")), checks(tmp_path / "run.db")
    with sqlite3.connect(tmp_path / "run.db") as c:
        said = dict(d.split(": ", 1) for (d,) in c.execute(
            "SELECT detail FROM events WHERE kind = 'precision-check-unreproducible'").fetchall())
    # norm, the Sequential holding the switch, comes first in the rotation
    assert said["norm"].startswith("a decision inside its call (an argmax or top-k index, a comparison) came out "
                                   "otherwise in FP32")


def test_checks_leave_numpy_and_python_draws_as_they_were(tmp_path):
    def norm():
        return nn.Sequential(HostRandomMask(), nn.LayerNorm(64))

    seeded_hosts()
    plain, _ = train(None, norm())
    plain_draws = np.random.rand(), random.random()
    seeded_hosts()
    checked, _ = train(tmp_path / "run.db", norm(), precision_budget=1.0)
    assert len(checks(tmp_path / "run.db")) >= 10
    assert all(torch.equal(a, b) for a, b in zip(plain, checked))
    assert (np.random.rand(), random.random()) == plain_draws


def test_checks_leave_the_training_bit_identical(tmp_path):
    # Dropout draws from the RNG and BatchNorm updates its running statistics in forward:
    # a check's copy must do neither to the model's.
    def norm():
        return nn.Sequential(nn.Dropout(0.2), nn.BatchNorm1d(64))

    plain, plain_draw = train(None, norm())
    checked, checked_draw = train(tmp_path / "run.db", norm(), precision_budget=1.0)
    assert len(checks(tmp_path / "run.db")) >= 10
    assert all(torch.equal(a, b) for a, b in zip(plain, checked))
    assert torch.equal(plain_draw, checked_draw)


def test_a_zero_budget_checks_nothing(tmp_path):
    train(tmp_path / "run.db", RMSNorm(64), batch_scale=300.0, precision_budget=0)
    assert checks(tmp_path / "run.db") == []


def test_modules_run_in_fp32_are_not_checked(tmp_path):
    train(tmp_path / "run.db", RMSNorm(64), autocast=False, precision_budget=1.0)
    assert checks(tmp_path / "run.db") == []


class ArmedLayerNorm(nn.LayerNorm):
    """Counts the forward pre-hooks registered on it: the precision checks arm a module with
    one (ampdiag puts no other on a submodule)."""

    armed = 0

    def register_forward_pre_hook(self, *args, **kwargs):
        self.armed += 1
        return super().register_forward_pre_hook(*args, **kwargs)


def test_a_module_run_in_fp32_is_armed_at_ever_fewer_of_its_turns(tmp_path):
    norm = ArmedLayerNorm(64)
    train(tmp_path / "run.db", norm, steps=60, autocast=False, precision_budget=1.0)
    # Its turn comes every third step (20 turns): armed at turns 0, 2, 6 and 14, where
    # each turn used to arm it.
    assert norm.armed == 4


def test_a_module_sitting_out_its_turns_is_checked_again_once_autocast_is_on(tmp_path):
    train(tmp_path / "run.db", nn.LayerNorm(64), steps=60, autocast_from=30, precision_budget=1.0)
    assert [step for step, module, *_ in checks(tmp_path / "run.db") if module == "norm" and step >= 30]


def test_the_default_budget_keeps_checks_to_a_small_share_of_the_steps(tmp_path):
    train(tmp_path / "run.db", nn.LayerNorm(64), steps=60)
    assert 1 <= len(checks(tmp_path / "run.db")) < 30


@pytest.mark.parametrize("budget", [-0.1, 1.5, float("nan"), "all", True])
def test_a_budget_that_is_no_share_of_time_is_refused(tmp_path, budget):
    model = Net(nn.LayerNorm(64))
    with pytest.raises(ValueError, match="precision_budget must be a share of the training time"):
        ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=str(tmp_path / "run.db"), precision_budget=budget)
    assert not (tmp_path / "run.db").exists()


def test_a_module_with_a_hook_of_the_users_is_left_unchecked_and_its_hook_sees_only_the_models_calls(tmp_path):
    norm = nn.LayerNorm(64)
    calls = []
    norm.register_forward_hook(lambda module, args, output: calls.append(output.dtype))
    train(tmp_path / "run.db", norm, steps=6, precision_budget=1.0)
    assert calls == [torch.float16] * 6  # a copy's FP32 call would have added a float32 one
    assert "norm" not in {c[1] for c in checks(tmp_path / "run.db")}


def test_a_module_computed_through_torchs_own_hooks_is_checked_as_it_computes(tmp_path):
    # The old weight_norm recomputes the weight in a forward pre-hook: a copy without it
    # would run a stale weight and look far from fp16.
    with pytest.warns(FutureWarning):
        norm = torch.nn.utils.weight_norm(nn.Linear(64, 64))
    train(tmp_path / "run.db", norm, steps=6, precision_budget=1.0)
    found = [c for c in checks(tmp_path / "run.db") if c[1] == "norm"]
    assert found and all(c[4] < 1e-2 for c in found), found


def test_info_counts_the_checks_and_export_lists_them(tmp_path, ampdiag_cli):
    import subprocess
    train(tmp_path / "run.db", nn.LayerNorm(64), steps=6, precision_budget=1.0)
    info = subprocess.run([ampdiag_cli, "info", str(tmp_path / "run.db")], capture_output=True, text=True, check=True)
    assert "precision:       6 checks against FP32 (precision_checks)" in info.stdout
    exported = subprocess.run([ampdiag_cli, "export", str(tmp_path / "run.db"), "--format", "csv", "--table",
                               "precision_checks"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert exported[0] == "step,module,dtype,numel,rel_error,zeroed,fp32_absmax" and len(exported) == 7


def train_cuda(db, norm, x, steps=9):
    """fp16 AMP steps of Net(norm) on CUDA with every precision check in budget, under sync
    debug mode "error": the checks never wait for the device."""
    torch.manual_seed(0)
    model = Net(norm).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    with ampdiag.attach(model, scaler, db=str(db), precision_budget=1.0):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(steps):
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")


@cuda_only
def test_on_cuda_the_checks_are_read_back_without_a_host_sync(tmp_path):
    train_cuda(tmp_path / "run.db", RMSNorm(64), torch.randn(32, 16, device="cuda") * 300)
    found = checks(tmp_path / "run.db")
    assert {c[1] for c in found} == {"inp", "norm", "out"}, found
    assert [c[0] for c in found] == sorted(c[0] for c in found)  # each at the step it was made in
    assert all(c[4] > 0.9 for c in found if c[1] == "norm") and all(c[4] < 1e-2 for c in found if c[1] != "norm")


@cuda_only
def test_on_cuda_a_call_that_draws_dropout_masks_is_not_compared_and_says_why(tmp_path):
    # CUDA's dropout kernel maps its draws to elements by dtype: the FP32 copy, from the same
    # generator state, drew other masks, and a healthy GPT-2 block came out 40 % "lost".
    train_cuda(tmp_path / "run.db", nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1)),
               torch.randn(32, 16, device="cuda"))
    found = checks(tmp_path / "run.db")
    assert {c[1] for c in found} == {"inp", "norm.0", "out"}, found
    assert all(c[4] < 1e-2 for c in found)
    with sqlite3.connect(tmp_path / "run.db") as c:
        events = c.execute("SELECT detail FROM events WHERE kind = 'precision-check-unreproducible'").fetchall()
    assert [d for (d,) in events if d.startswith("norm: its call drew random numbers on the device")] != []
