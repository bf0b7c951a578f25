"""A loop that never calls optimizer.zero_grad(): every step adds its gradients to all the
earlier ones until they overflow fp16 and the scale collapses. The report used to blame
the last layer's gradients as beyond fp16's range and tell the user to shrink the loss and
pin the layer to FP32; it names the missing zero_grad() first, and the loop with it is
healthy. And its twin: zero_grad(set_to_none=False) between backward and scaler.step(),
where nothing trains and nothing overflows (with set_to_none=True torch raises). And the
one inside gradient accumulation, zero_grad() before every micro-batch, where each step
applies its last micro-batch alone: nothing overflows, the loss still falls. And a loss that
training brought to exactly 0 (a triplet margin every triplet meets), whose zero gradients
are no fault: the report used to fail that healthy run as 'nothing trains'."""
import torch
from torch import nn

import ampdiag
from conftest import rows, rules
from fp16_loop import Mlp, batches
from regression_loop import regression_loop


def regression(db, zero_grad, steps=40, clear_after_backward=False):
    """The regression loop; returns its final loss scale."""

    def clear(scaler, opt, model):
        opt.zero_grad(set_to_none=False)  # misplaced: the step gets zeros

    return regression_loop(db, steps, zero_grad=zero_grad, between=clear if clear_after_backward else None)[1]


def test_a_loop_without_zero_grad_is_told_so_first_and_no_layer_is_blamed(tmp_path, verdict):
    assert regression(tmp_path / "stale.db", zero_grad=False) < 1.0  # the sum overflowed, the scale collapsed
    code, rep = verdict(tmp_path / "stale.db")
    assert code == 1
    first = rep["findings"][0]
    assert (first["rule"], first["severity"]) == ("gradients-not-zeroed", "error")
    assert first["suggestions"][0]["python"].startswith("optimizer.zero_grad()")
    assert [rule for rule, module in rules(rep, "error") if module] == []  # no layer named as the cause
    origin = [f for f in rep["findings"] if f["rule"] == "overflow-origin"]
    assert origin and all("see gradients-not-zeroed" in f["suggestions"][0]["summary"] for f in origin)


def test_the_same_loop_with_zero_grad_is_healthy(tmp_path, verdict):
    regression(tmp_path / "zeroed.db", zero_grad=True)
    code, rep = verdict(tmp_path / "zeroed.db")
    assert code == 0, rep["findings"]
    assert "gradients-not-zeroed" not in [rule for rule, _ in rules(rep)]


def test_gradients_cleared_between_backward_and_step_are_named(tmp_path, verdict):
    regression(tmp_path / "cleared.db", zero_grad=False, clear_after_backward=True)
    code, rep = verdict(tmp_path / "cleared.db")
    assert code == 1
    assert rules(rep, "error") == [("gradients-cleared", "")]
    assert rep["findings"][0]["suggestions"][0]["python"].startswith("optimizer.zero_grad()  # before the backward")


def saturated_contrastive(db, steps=20):
    """SimCLR-style views of one batch at a temperature so small that the loss is exactly 0
    (every pair already separated): backward delivers nothing but zeros."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 64))
    opt, scaler = torch.optim.AdamW(model.parameters(), 1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x = torch.randn(64, 32)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                z1 = nn.functional.normalize(model(x + 0.1 * torch.randn_like(x)), dim=1)
                z2 = nn.functional.normalize(model(x + 0.1 * torch.randn_like(x)), dim=1)
                loss = nn.functional.cross_entropy(z1 @ z2.t() / 0.001, torch.arange(64))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_gradients_that_backward_made_zero_are_the_losss_not_a_cleared_loop(tmp_path, verdict):
    saturated_contrastive(tmp_path / "saturated.db")
    code, rep = verdict(tmp_path / "saturated.db")
    assert code == 1
    assert rules(rep, "error") == [("zero-gradients", "")]
    assert rep["findings"][0]["suggestions"][0]["summary"].startswith("Look at the loss, not at zero_grad()")


def test_zero_grad_inside_the_accumulation_loop_is_named_and_no_layer_is_blamed(tmp_path, verdict):
    regression_loop(tmp_path / "inside.db", 12, micro=4, zero_each_micro_batch=True)
    code, rep = verdict(tmp_path / "inside.db")
    assert code == 1
    assert rules(rep, "error") == [("accumulated-gradients-cleared", "")]
    assert "in 12 of the 12 steps from step 0" in rep["findings"][0]["evidence"]


def test_the_accumulation_loop_zeroed_once_per_step_as_the_report_says_is_healthy(tmp_path, verdict):
    regression_loop(tmp_path / "once.db", 12, micro=4)
    code, rep = verdict(tmp_path / "once.db")
    assert code == 0, rep["findings"]
    assert "accumulated-gradients-cleared" not in [rule for rule, _ in rules(rep)]


def test_pytorchs_dcgan_loop_with_a_scaler_per_network_is_healthy_for_both(tmp_path, verdict):
    # The generator's backward runs through the discriminator after the discriminator's step;
    # the discriminator's zero_grad() at the start of its next step clears what it added.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    disc = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), 2e-4, betas=(0.5, 0.999))
    scaler_g, scaler_d = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    bce = nn.BCEWithLogitsLoss()
    dbs = tmp_path / "generator.db", tmp_path / "discriminator.db"
    with ampdiag.attach(gen, scaler_g, optimizer=opt_g, db=dbs[0]), \
            ampdiag.attach(disc, scaler_d, optimizer=opt_d, db=dbs[1]):
        for _ in range(20):
            real, z = torch.randn(32, 16) * 0.5 + 1.0, torch.randn(32, 8)
            disc.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gen(z)
                loss_d = bce(disc(real).float(), torch.ones(32, 1)) + bce(disc(fake.detach()).float(), torch.zeros(32, 1))
            scaler_d.scale(loss_d).backward()
            scaler_d.step(opt_d)
            scaler_d.update()
            gen.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss_g = bce(disc(fake).float(), torch.ones(32, 1))
            scaler_g.scale(loss_g).backward()
            scaler_g.step(opt_g)
            scaler_g.update()
    for db in dbs:
        code, rep = verdict(db)
        assert code == 0, (db.name, rep["findings"])
        assert not {"gradients-not-zeroed", "accumulated-gradients-cleared"} & {rule for rule, _ in rules(rep)}


def sharpness_aware(db, gain, steps=16):
    """SAM with a scaler: the first backward's gradient moves the weights uphill (skipped
    where it overflowed), zero_grad(), the second backward's gradient steps from where they
    were. `gain` multiplies the middle layer's weights."""
    torch.manual_seed(0)
    model = Mlp()
    with torch.no_grad():
        model.b.weight.mul_(gain)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for x, y in batches(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            grads = [p.grad / scaler.get_scale() for p in model.parameters()]
            norm = torch.stack([g.norm() for g in grads]).norm()
            moved = []
            if torch.isfinite(norm):
                with torch.no_grad():
                    for p, g in zip(model.parameters(), grads):
                        moved.append(g * (0.05 / (norm + 1e-12)))
                        p.add_(moved[-1])
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), moved):
                    p.sub_(e)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


def test_sharpness_aware_steps_whose_first_gradient_overflowed_are_not_a_cleared_accumulation(tmp_path, verdict):
    # Where the first gradient held Inf, SAM leaves the weights in place and clears it, as a
    # misplaced zero_grad() would: the agent records it, and the report does not count a
    # step the scaler skipped, which applied nothing.
    sharpness_aware(tmp_path / "sam.db", gain=3000.0)
    cleared_at = [s for (s,) in rows(tmp_path / "sam.db", "SELECT step FROM events WHERE kind = "
                                     "'accumulated-gradients-cleared'")]
    skipped = {s for (s,) in rows(tmp_path / "sam.db", "SELECT step FROM steps WHERE skipped")}
    assert cleared_at and set(cleared_at) <= skipped
    code, rep = verdict(tmp_path / "sam.db")
    assert code == 1  # the oversized layer's overflows are still errors
    assert "accumulated-gradients-cleared" not in [rule for rule, _ in rules(rep)]


def test_sharpness_aware_training_is_healthy(tmp_path, verdict):
    sharpness_aware(tmp_path / "sam.db", gain=1.0)
    code, rep = verdict(tmp_path / "sam.db")
    assert code == 0, rep["findings"]


def converging_triplets(db, steps=60):
    """A metric-learning loop whose triplet margin loss every triplet meets after a few steps
    of training: from then on the loss is exactly 0 and backward delivers only zeros."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 16))
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(4, 32, generator=g) * 0.3
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            c = torch.randint(0, 4, (32,), generator=g)
            o = (c + 1 + torch.randint(0, 3, (32,), generator=g)) % 4
            a, p, n = (centers[k] + 0.3 * torch.randn(32, 32, generator=g) for k in (c, c, o))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.triplet_margin_loss(model(a), model(p), model(n), margin=0.5)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_a_loss_that_training_brought_to_exactly_0_is_information_and_the_run_healthy(tmp_path, verdict):
    converging_triplets(tmp_path / "triplets.db")
    code, rep = verdict(tmp_path / "triplets.db")
    assert code == 0, rep["findings"]
    assert [(f["rule"], f["severity"]) for f in rep["findings"]] == [("zero-gradients", "info")]
    assert rep["findings"][0]["title"].startswith("The loss reached exactly 0 at step")
