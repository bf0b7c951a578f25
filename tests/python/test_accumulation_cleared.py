"""zero_grad() inside the loop over micro-batches: the agent records event
"accumulated-gradients-cleared" at each optimizer step where a backward of the step's
scaled loss found the probe parameter's .grad gone (None, or zeros where it had held
values) after an earlier one had added to it. Accumulation zeroed once per step, a second
network's backward through the model, and a loop without accumulation record none."""
import sqlite3

import torch
from torch import nn

import ampdiag
from test_stale_gradients import gan_run, model

EVENT = "accumulated-gradients-cleared"


def cleared(db):
    with sqlite3.connect(db) as c:
        return c.execute(f"SELECT step, detail FROM events WHERE kind = '{EVENT}' ORDER BY step").fetchall()


def fp16_training():
    """The model, its SGD, a GradScaler and one batch."""
    net = model()
    return (net, torch.optim.SGD(net.parameters(), lr=1e-3), torch.amp.GradScaler("cpu", init_scale=1024.0),
            torch.randn(16, 8), torch.randn(16, 1))


def accumulation_run(db, zero_every_micro_batch, steps=3, micro=4, set_to_none=True, drop=()):
    """`steps` optimizer steps of `micro` fp16 micro-batches each; zero_grad() before every
    micro-batch or once per step. `drop`: (step, micro-batch) pairs whose gradients a guard
    throws away with zero_grad() after their backward."""
    net, opt, scaler, x, y = fp16_training()
    with ampdiag.attach(net, scaler, db=db):
        for step in range(steps):
            for k in range(micro):
                if zero_every_micro_batch or k == 0:
                    opt.zero_grad(set_to_none=set_to_none)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(net(x).float(), y) / micro
                scaler.scale(loss).backward()
                if (step, k) in drop:
                    opt.zero_grad(set_to_none=set_to_none)
            scaler.step(opt)
            scaler.update()
    return cleared(db)


def test_zero_grad_before_every_micro_batch_is_recorded_at_every_step(tmp_path):
    detail = ("2.bias's gradient was set to None after micro-batches 1, 2, 3 of 4, before the next one's backward: "
              "the optimizer step applied the gradients of micro-batch 4 alone")
    assert accumulation_run(tmp_path / "run.db", True) == [(0, detail), (1, detail), (2, detail)]


def test_zeroing_in_place_before_every_micro_batch_is_recorded_as_zeroed(tmp_path):
    events = accumulation_run(tmp_path / "run.db", True, set_to_none=False)
    assert [step for step, _ in events] == [0, 1, 2]
    assert events[0][1].startswith("2.bias's gradient was zeroed after micro-batches 1, 2, 3 of 4")


def test_zeroing_once_per_optimizer_step_records_nothing(tmp_path):
    assert accumulation_run(tmp_path / "none.db", False) == []
    assert accumulation_run(tmp_path / "zeros.db", False, set_to_none=False) == []


def test_a_micro_batch_a_guard_drops_is_recorded_at_its_step_alone(tmp_path):
    assert accumulation_run(tmp_path / "run.db", False, drop={(1, 1)}) == [
        (1, "2.bias's gradient was set to None after micro-batch 2 of 4, before the next one's backward: the optimizer "
            "step applied the gradients of micro-batches 3, 4 alone")]


def test_one_backward_per_step_records_nothing(tmp_path):
    assert accumulation_run(tmp_path / "run.db", True, micro=1) == []


def test_a_generators_backward_through_the_discriminator_zeroed_before_its_step_records_nothing(tmp_path):
    # Its gradients in the discriminator come from the generator's scaler, not this run's.
    gan_run(tmp_path / "run.db", lambda opt: opt.zero_grad())
    assert cleared(tmp_path / "run.db") == []


def two_backward_run(db, between, combine=None, steps=3):
    """Two fp16 backwards a step with `between(net, opt)` after the first; `combine(grads)`,
    given each backward's gradients, sets .grad by hand before scaler.step()."""
    net, opt, scaler, x, y = fp16_training()
    with ampdiag.attach(net, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            grads = []
            for k in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(net(x).float(), y) * (k + 1)
                scaler.scale(loss).backward()
                grads.append([p.grad.clone() for p in net.parameters()])
                if k == 0:
                    between(net, opt)
            if combine is not None:
                opt.zero_grad()
                for p, *parts in zip(net.parameters(), *grads):
                    p.grad = combine(parts)
            scaler.step(opt)
            scaler.update()
    return cleared(db)


def test_a_sharpness_aware_first_step_that_clears_after_moving_the_weights_records_nothing(tmp_path):
    # SAM: the first backward's gradient moves the weights to the nearby worst case, then is
    # cleared; the second backward's, taken there, is the one the optimizer applies.
    def ascend(net, opt):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(p.grad, alpha=1e-6)
        opt.zero_grad()

    assert two_backward_run(tmp_path / "run.db", ascend) == []


def test_per_task_gradients_combined_into_grad_by_hand_record_nothing(tmp_path):
    # Gradient surgery: each task's gradient after its own zero_grad(), their sum set as .grad.
    assert two_backward_run(tmp_path / "run.db", lambda net, opt: opt.zero_grad(), combine=sum) == []


def test_the_same_two_backwards_cleared_in_between_and_stepped_as_left_are_recorded(tmp_path):
    assert [step for step, _ in two_backward_run(tmp_path / "run.db", lambda net, opt: opt.zero_grad())] == [0, 1, 2]


def input_gradient_run(db, make_input, receives=None):
    """Two backwards a step, zero_grad() between them: the first on a batch `make_input(x)`
    gives the model, the second on that batch perturbed by the sign of the gradient it gave
    `receives` (the batch given where None: FGSM adversarial training)."""
    net, opt, scaler, x, y = fp16_training()
    with ampdiag.attach(net, scaler, db=db):
        for _ in range(3):
            given = make_input(x)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(net(given).float(), y)
            scaler.scale(loss).backward()
            leaf = given if receives is None else receives
            perturbed = (given + 0.01 * leaf.grad.sign()).detach()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(net(perturbed).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return cleared(db)


def test_a_backward_for_the_inputs_gradient_cleared_before_the_adversarial_step_records_nothing(tmp_path):
    assert input_gradient_run(tmp_path / "run.db", lambda x: x.clone().requires_grad_()) == []


def test_a_backward_for_a_perturbations_gradient_given_as_input_plus_perturbation_records_nothing(tmp_path):
    # PGD writes the model's input as x + delta, delta the leaf that receives the gradient.
    delta = torch.zeros(16, 8, requires_grad=True)
    assert input_gradient_run(tmp_path / "run.db", lambda x: x + delta, receives=delta) == []


def test_a_parameter_given_as_the_input_and_cleared_between_backwards_is_recorded(tmp_path):
    # A soft prompt passed to the model is trained as its own parameters are: its backward
    # is a micro-batch's, not a look at an input's gradient.
    assert [step for step, _ in input_gradient_run(tmp_path / "run.db", nn.Parameter)] == [0, 1, 2]


def bf16_accumulation_run(db, zero_every_micro_batch, steps=3, micro=4):
    """The accumulation loop in bf16 without a scaler, the optimizer given to attach()."""
    net, opt, _, x, y = fp16_training()
    with ampdiag.attach(net, optimizer=opt, db=db):
        for _ in range(steps):
            for k in range(micro):
                if zero_every_micro_batch or k == 0:
                    opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.mse_loss(net(x).float(), y) / micro
                loss.backward()
            opt.step()
    return cleared(db)


def test_zero_grad_before_every_micro_batch_without_a_scaler_is_recorded_at_every_step(tmp_path):
    assert [step for step, _ in bf16_accumulation_run(tmp_path / "run.db", True)] == [0, 1, 2]
    assert bf16_accumulation_run(tmp_path / "once.db", False) == []


def test_a_bf16_dcgan_whose_generator_steps_between_the_discriminators_backwards_records_nothing(tmp_path):
    # PyTorch's DCGAN order without a scaler, the discriminator attached: the generator's
    # backward adds to its gradients, the generator's step() follows, then the
    # discriminator's zero_grad() clears them before its own backwards.
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    bce = nn.BCEWithLogitsLoss()
    with ampdiag.attach(disc, optimizer=opt_d, db=tmp_path / "run.db"):
        for _ in range(4):
            real, z = torch.randn(16, 8), torch.randn(16, 4)
            opt_d.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fake = gen(z)
                bce(disc(real).float(), torch.ones(16, 1)).backward()
                bce(disc(fake.detach()).float(), torch.zeros(16, 1)).backward()
            opt_d.step()
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                bce(disc(fake).float(), torch.ones(16, 1)).backward()
            opt_g.step()
    assert cleared(tmp_path / "run.db") == []
