"""Everyday CUDA loops and their mistakes, with the Python agent attached: the healthy
ones make no host sync (torch's sync debug mode set to "error" stays silent) and their
report passes `--fail-on error`; each mistake the agent watches for on the host is
recorded on CUDA too, at the step it happened, and the report names it. Skipped without a
CUDA device."""
import contextlib
import json
import sqlite3
import subprocess

import pytest
import torch
from torch import nn

import ampdiag

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def loop(db, steps=8, zero=lambda opt: opt.zero_grad(set_to_none=True), backward=None, before_step=None,
         after_step=None, init_scale=1024.0, sync_free=True):
    """A fused-Adam fp16 loop on CUDA. `zero(opt)` starts each step; `backward(scaler, loss)`
    replaces scaler.scale(loss).backward(); `before_step(scaler, opt, model)` runs before
    scaler.step(opt), `after_step(step, model, x)` after scaler.update(). Returns the run's
    events as (kind, step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 1, device="cuda")
    with ampdiag.attach(model, scaler, db=db, overwrite=True):
        with no_host_sync() if sync_free else contextlib.nullcontext():
            for step in range(steps):
                zero(opt)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                if backward is None:
                    scaler.scale(loss).backward()
                else:
                    backward(scaler, loss)
                if before_step is not None:
                    before_step(scaler, opt, model)
                scaler.step(opt)
                scaler.update()
                if after_step is not None:
                    after_step(step, model, x)
    with sqlite3.connect(db) as c:
        return c.execute("SELECT kind, step FROM events ORDER BY id").fetchall()


def kinds(events):
    return {kind for kind, _ in events}


def report_errors(ampdiag_cli, db):
    """The rules of the report's error findings, and its exit code under --fail-on error."""
    result = subprocess.run([ampdiag_cli, "report", str(db), "--fail-on", "error", "--format", "json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr
    findings = json.loads(result.stdout)["findings"]
    return result.returncode, {f["rule"] for f in findings if f["severity"] == "error"}


def test_a_loop_that_zeroes_its_gradients_to_zeros_makes_no_host_sync(tmp_path):
    # set_to_none=False leaves .grad tensors of zeros, which the stale-gradient probe reads.
    events = loop(tmp_path / "run.db", zero=lambda opt: opt.zero_grad(set_to_none=False))
    assert "gradients-not-zeroed" not in kinds(events)


def test_a_healthy_cuda_loop_passes_fail_on_error(tmp_path, ampdiag_cli):
    loop(tmp_path / "run.db", steps=20)
    assert report_errors(ampdiag_cli, tmp_path / "run.db") == (0, set())


def test_a_cuda_loop_that_never_zeroes_its_gradients_is_recorded_at_its_second_step(tmp_path, ampdiag_cli):
    events = loop(tmp_path / "run.db", zero=lambda opt: None)
    assert ("gradients-not-zeroed", 1) in events
    assert "gradients-not-zeroed" in report_errors(ampdiag_cli, tmp_path / "run.db")[1]


def test_a_backward_from_the_loss_given_to_scale_is_recorded_without_a_host_sync(tmp_path):
    def wrong(scaler, loss):
        scaler.scale(loss)
        loss.backward()

    assert ("unscaled-backward", 0) in loop(tmp_path / "run.db", backward=wrong)


def test_clipping_before_unscale_is_named_from_the_device_statistics(tmp_path, ampdiag_cli):
    def clip(scaler, opt, model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    loop(tmp_path / "run.db", steps=12, before_step=clip)
    assert "clip-before-unscale" in report_errors(ampdiag_cli, tmp_path / "run.db")[1]


def test_gradients_zeroed_between_backward_and_step_are_named_from_the_device_statistics(tmp_path, ampdiag_cli):
    loop(tmp_path / "run.db", steps=8, before_step=lambda scaler, opt, model: opt.zero_grad(set_to_none=False))
    assert "gradients-cleared" in report_errors(ampdiag_cli, tmp_path / "run.db")[1]


def test_zero_grad_between_micro_batches_is_recorded_at_every_step_without_a_host_sync(tmp_path, ampdiag_cli):
    # Two micro-batches a step, set to None in between: seen without reading the device.
    held = {}

    def zero(opt):
        held["opt"] = opt
        opt.zero_grad()

    def two_micro_batches(scaler, loss):
        scaler.scale(loss / 2).backward(retain_graph=True)
        held["opt"].zero_grad()
        scaler.scale(loss / 2).backward()

    events = loop(tmp_path / "run.db", zero=zero, backward=two_micro_batches)
    assert [step for kind, step in events if kind == "accumulated-gradients-cleared"] == list(range(8))
    assert "accumulated-gradients-cleared" in report_errors(ampdiag_cli, tmp_path / "run.db")[1]


def test_an_optimizer_stepped_outside_the_scaler_is_recorded_without_a_host_sync(tmp_path, ampdiag_cli):
    # scaler.step() forgotten: opt.step() applies gradients still multiplied by the scale.
    torch.manual_seed(0)
    model = nn.Linear(16, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    x = torch.randn(64, 16, device="cuda")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db", overwrite=True):
        with no_host_sync():
            for _ in range(3):
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                opt.step()
    with sqlite3.connect(tmp_path / "run.db") as c:
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'optimizer-outside-scaler'").fetchone()[0] == 1
        assert c.execute("SELECT scale_before, scale_after, skipped FROM steps ORDER BY step").fetchall() == \
            [(1024.0, 1024.0, 0)] * 3
    assert "optimizer-outside-scaler" in report_errors(ampdiag_cli, tmp_path / "run.db")[1]



def test_a_validation_pass_between_cuda_steps_makes_no_host_sync(tmp_path, ampdiag_cli):
    # The evaluation look reads host outputs only: a device output would wait for the device.
    def validate(step, model, x):
        if step % 2:
            model.eval()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                model(x * 1e5)  # overflows fp16: not looked at on the device
            model.train()

    loop(tmp_path / "run.db", steps=6, after_step=validate)
    with sqlite3.connect(tmp_path / "run.db") as c:
        assert c.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 6
    assert report_errors(ampdiag_cli, tmp_path / "run.db") == (0, set())


def test_a_head_swapped_in_on_cuda_is_a_layer_with_its_output_watched_without_a_host_sync(tmp_path, ampdiag_cli):
    # Fine-tuning on new labels: the head replaced after attach(), a new optimizer. Its
    # tensors are found through the model, its output is watched from its next call, and
    # none of that waits for the device.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
    # A fused optimizer: torch's scaler.step() reads found_inf on the host for the others.
    opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), torch.amp.GradScaler("cuda")
    x = torch.randn(64, 16, device="cuda")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, scaler, db=db, activation_every=1):
        with no_host_sync():
            for step in range(6):
                if step == 2:
                    model[2] = nn.Linear(64, 3, device="cuda")  # .cuda() would copy from the host
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    with sqlite3.connect(db) as c:
        assert [n for (n,) in c.execute("SELECT name FROM layers WHERE id >= 4 ORDER BY id")] == \
            ["2.weight (from step 2)", "2.bias (from step 2)"]
        assert c.execute("SELECT COUNT(*) FROM grad_stats g JOIN layers l ON l.id = g.layer_id "
                         "WHERE l.name LIKE '2.%(from step 2)'").fetchone()[0] == 8  # steps 2-5, two tensors
        watched = {s for (s,) in c.execute("SELECT a.step FROM act_stats a JOIN modules m ON m.id = a.module_id "
                                           "WHERE m.path = '2'")}
        assert {3, 4, 5} <= watched
    assert report_errors(ampdiag_cli, db) == (0, set())


def test_sharpness_aware_training_on_cuda_is_healthy_without_a_host_sync(tmp_path, ampdiag_cli):
    # SAM: two scaled backwards a step with zero_grad() between, the weights moved uphill in
    # between (by nothing where the first gradient overflowed: decided on the device).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    # Fused Adam: torch's scaler.step() syncs for unfused optimizers, and a fused SGD with
    # momentum whose first step is skipped is broken by torch itself (fused-sgd-momentum).
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 1, device="cuda")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, scaler, db=db):
        with no_host_sync():
            for _ in range(10):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                grads = [p.grad / scaler._get_scale_async() for p in model.parameters()]  # get_scale() syncs
                norm = torch.stack([g.norm() for g in grads]).norm()
                rho = torch.where(torch.isfinite(norm), 0.05 / (norm + 1e-12), torch.zeros_like(norm))
                moved = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) * rho for g in grads]
                with torch.no_grad():
                    torch._foreach_add_(list(model.parameters()), moved)
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                with torch.no_grad():
                    torch._foreach_sub_(list(model.parameters()), moved)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert report_errors(ampdiag_cli, db) == (0, set())


def plain_run(db, model, opt, scaler, steps):
    """`steps` fp16 MSE steps of `model` on one CUDA batch under attach() and sync debug
    mode "error"."""
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 1, device="cuda")
    with ampdiag.attach(model, scaler, db=db):
        with no_host_sync():
            for _ in range(steps):
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()


def test_fused_sgd_whose_first_step_was_skipped_is_named_without_a_host_sync(tmp_path, ampdiag_cli):
    # torch's fused SGD leaves the momentum buffers it creates unfilled where the scaler
    # skips that step: the agent's look at them is reduced on the device and read later.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**24)  # the first steps overflow
    db = tmp_path / "run.db"
    plain_run(db, model, opt, scaler, 12)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT step FROM events WHERE kind = 'fused-momentum-uninitialised'").fetchall() == [(0,)]
    assert report_errors(ampdiag_cli, db)[1] >= {"fused-sgd-momentum"}


def test_a_learning_rate_far_too_high_is_named_from_weights_read_on_the_device(tmp_path, ampdiag_cli):
    # The weights' norms of device parameters are reduced there and read back later: the
    # report puts the overflows on the learning rate, not on the module that overflowed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
    db = tmp_path / "run.db"
    plain_run(db, model, torch.optim.AdamW(model.parameters(), lr=0.3, fused=True), torch.amp.GradScaler("cuda"), 40)
    with sqlite3.connect(db) as c:
        steps = {s for (s,) in c.execute("SELECT step FROM weight_norms")}
    assert {0, 1, 2, 3, 4} <= steps
    assert "weight-growth" in report_errors(ampdiag_cli, db)[1]


def test_a_cuda_dcgan_whose_discriminator_is_zeroed_at_its_own_step_is_not_told_otherwise(tmp_path, ampdiag_cli):
    # PyTorch's DCGAN order: the generator's backward runs through the attached discriminator
    # after its step, and its zero_grad() at the start of its next step clears that: the
    # device answer is settled against the cycle's later looks.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8)).cuda()
    disc = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).cuda()
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), fused=True), torch.optim.Adam(disc.parameters(), fused=True)
    scaler_g, scaler_d = torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(16, 1, device="cuda"), torch.zeros(16, 1, device="cuda")
    db = tmp_path / "run.db"
    for set_to_none in (True, False):
        with ampdiag.attach(disc, scaler_d, optimizer=opt_d, db=db, overwrite=True):
            with no_host_sync():
                for _ in range(6):
                    real, z = torch.randn(16, 8, device="cuda"), torch.randn(16, 4, device="cuda")
                    opt_d.zero_grad(set_to_none=set_to_none)
                    with torch.autocast("cuda", dtype=torch.float16):
                        fake = gen(z)
                        loss_d = bce(disc(real).float(), ones) + bce(disc(fake.detach()).float(), zeros)
                    scaler_d.scale(loss_d).backward()
                    scaler_d.step(opt_d)
                    scaler_d.update()
                    opt_g.zero_grad()
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss_g = bce(disc(fake).float(), ones)
                    scaler_g.scale(loss_g).backward()
                    scaler_g.step(opt_g)
                    scaler_g.update()
        with sqlite3.connect(db) as c:
            assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'gradients-not-zeroed'").fetchone() == (0,)


def train_half(steps, db=None):
    """Pure fp16 SGD on CUDA (`model.half()`, no master weights): with attach() sampling every
    4th step under sync debug mode "error", or, without `db`, comparing each step's weights
    directly. Returns the parameters and the direct rows (step, layer, elements with a finite
    non-zero gradient, of those the ones the step left unchanged)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).cuda().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(128, 32, device="cuda").half(), torch.randn(128, 1, device="cuda")
    direct = []
    watched = db is not None
    with ampdiag.attach(model, optimizer=opt, db=db, every=4) if watched else contextlib.nullcontext():
        with no_host_sync() if watched else contextlib.nullcontext():
            for step in range(steps):
                opt.zero_grad()
                nn.functional.mse_loss(model(x).float(), y).backward()
                before = [] if watched else [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
                opt.step()
                for layer, (p, (old, grad)) in enumerate(zip(model.parameters(), before)):
                    moved = torch.isfinite(grad) & (grad != 0)
                    direct.append((step, layer, int(moved.sum()), int((moved & (p.detach() == old)).sum())))
    return [p.detach().cpu() for p in model.parameters()], direct


def test_stalled_updates_of_fp16_weights_are_counted_on_the_device_without_a_host_sync(tmp_path):
    # The counts are reduced on the device and read back once their copy has landed.
    db = tmp_path / "run.db"
    watched, _ = train_half(9, db)
    plain, direct = train_half(9)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
    with sqlite3.connect(db) as c:
        recorded = c.execute("SELECT step, layer_id, nonzero, stalled FROM weight_updates ORDER BY step, layer_id").fetchall()
    assert recorded == [r for r in direct if r[0] % 4 == 0]
    assert any(stalled > nonzero // 2 for _, _, nonzero, stalled in recorded)  # the case is a real one


def test_an_empty_cuda_parameter_has_zero_norms_beside_the_others_without_a_host_sync(tmp_path):
    # torch's foreach infinity norm raises for an empty tensor: the device read must not.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    model.register_parameter("none", nn.Parameter(torch.empty(0, device="cuda")))
    db = tmp_path / "run.db"
    plain_run(db, model, torch.optim.Adam(model.parameters(), fused=True), torch.amp.GradScaler("cuda"), 3)
    with sqlite3.connect(db) as c:
        recorded = dict(c.execute("SELECT l.name, w.l2 FROM weight_norms w JOIN layers l ON l.id = w.layer_id "
                                  "WHERE w.step = 0").fetchall())
    assert recorded["none"] == 0.0 and len(recorded) == 5
