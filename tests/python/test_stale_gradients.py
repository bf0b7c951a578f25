"""Gradients not zeroed between optimizer steps: the agent records event
"gradients-not-zeroed" once, at the first step whose probe parameter (the smallest
trainable one) still held the previous step's gradient; the zeroing loops torch documents
(set_to_none either way, accumulation over micro-batches) record none, nor does a
trainable parameter that no optimizer holds."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag

EVENT = "gradients-not-zeroed"


def events(db):
    with sqlite3.connect(db) as c:
        return c.execute(f"SELECT step, detail FROM events WHERE kind = '{EVENT}'").fetchall()


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def fp16_run(db, net, zero, steps=4, micro=1, params=None):
    """`zero(opt, net)` runs at the start of each optimizer step."""
    opt = torch.optim.SGD(params if params is not None else net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with ampdiag.attach(net, scaler, db=db):
        for _ in range(steps):
            zero(opt, net)
            for _ in range(micro):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(net(x).float(), y) / micro
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return events(db)


def never(opt, net):
    pass


def test_a_loop_that_never_zeroes_its_gradients_is_recorded_at_its_second_step(tmp_path):
    assert fp16_run(tmp_path / "run.db", model(), never) == [
        (1, "2.bias's gradient still held the previous optimizer step's values when this step's first gradient "
            "arrived: the gradients were not zeroed between steps")]


def test_zeroing_to_none_or_to_zeros_records_nothing(tmp_path):
    assert fp16_run(tmp_path / "none.db", model(), lambda opt, net: opt.zero_grad()) == []
    assert fp16_run(tmp_path / "zeros.db", model(), lambda opt, net: opt.zero_grad(set_to_none=False)) == []
    assert fp16_run(tmp_path / "model.db", model(), lambda opt, net: net.zero_grad()) == []


def test_accumulating_micro_batches_within_a_step_records_nothing(tmp_path):
    assert fp16_run(tmp_path / "run.db", model(), lambda opt, net: opt.zero_grad(), micro=4) == []


def test_a_trainable_parameter_no_optimizer_holds_keeps_its_gradient_unjudged(tmp_path):
    # The smallest trainable parameter (the head's bias) is left out of the optimizer, which
    # zeroes only its own: the bias's gradient adds up by design, nothing applies it.
    net = model()
    params = [p for name, p in net.named_parameters() if name != "2.bias"]
    assert fp16_run(tmp_path / "run.db", net, lambda opt, n: opt.zero_grad(), params=params) == []


def test_a_bf16_loop_without_a_scaler_that_never_zeroes_is_recorded(tmp_path):
    db = tmp_path / "run.db"
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with ampdiag.attach(net, optimizer=opt, db=db):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            opt.step()
    assert [step for step, _ in events(db)] == [1]


def gan_run(db, zero_discriminator, steps=4):
    """PyTorch's DCGAN loop with one GradScaler per network, the discriminator attached: the
    generator's backward runs through it and adds to its gradients after its step, and its
    zero_grad() at the start of its next step clears them. Returns its events."""
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    scaler_g, scaler_d = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    bce = nn.BCEWithLogitsLoss()
    with ampdiag.attach(disc, scaler_d, optimizer=opt_d, db=db):
        for _ in range(steps):
            real, z = torch.randn(16, 8), torch.randn(16, 4)
            zero_discriminator(opt_d)
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gen(z)
                loss_d = bce(disc(real).float(), torch.ones(16, 1)) + bce(disc(fake.detach()).float(), torch.zeros(16, 1))
            scaler_d.scale(loss_d).backward()
            scaler_d.step(opt_d)
            scaler_d.update()
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss_g = bce(disc(fake).float(), torch.ones(16, 1))
            scaler_g.scale(loss_g).backward()
            scaler_g.step(opt_g)
            scaler_g.update()
    return events(db)


def test_a_discriminators_gradients_from_the_generators_backward_zeroed_before_its_step_record_nothing(tmp_path):
    assert gan_run(tmp_path / "none.db", lambda opt: opt.zero_grad()) == []
    assert gan_run(tmp_path / "zeros.db", lambda opt: opt.zero_grad(set_to_none=False)) == []


def test_a_discriminator_never_zeroed_is_recorded_at_its_second_step(tmp_path):
    assert [step for step, _ in gan_run(tmp_path / "run.db", lambda opt: None)] == [1]


@pytest.fixture()
def grads_as_if_on_a_device(device_copies_on_the_host):
    """The probe's device path on host tensors: each .grad read as a device one would be."""


def test_on_a_device_a_discriminator_zeroed_before_its_step_records_nothing(tmp_path, grads_as_if_on_a_device):
    # The device answer is settled against the cycle's later looks, as the host one is: the
    # generator's backward through the discriminator, then its zero_grad(), then its step.
    assert gan_run(tmp_path / "none.db", lambda opt: opt.zero_grad()) == []
    assert gan_run(tmp_path / "zeros.db", lambda opt: opt.zero_grad(set_to_none=False)) == []


def test_on_a_device_a_discriminator_never_zeroed_is_recorded_at_its_second_step(tmp_path, grads_as_if_on_a_device):
    assert [step for step, _ in gan_run(tmp_path / "run.db", lambda opt: None)] == [1]


def test_on_a_device_a_loop_that_never_zeroes_is_recorded_at_its_second_step(tmp_path, grads_as_if_on_a_device):
    assert [step for step, _ in fp16_run(tmp_path / "run.db", model(), never)] == [1]
