"""A forward that went NaN/Inf and that no backward reached before the step ended is event
"forward-dropped" at its step: a loop guarding with `if not torch.isfinite(loss): continue`
loses the batch without any skipped step or NaN gradient to show for it. A forward whose
loss reaches backward, with its NaN or alongside another forward, is not one."""
import sqlite3

import torch
from torch import nn

import ampdiag

OVERFLOW = 1e5  # a batch this large overflows fp16 in the first Linear


def dropped(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT step, detail FROM events WHERE kind = 'forward-dropped'").fetchall()


def nan_steps(db):
    with sqlite3.connect(db) as c:
        return [s for (s,) in c.execute("SELECT DISTINCT step FROM act_stats WHERE nan + inf > 0 ORDER BY step")]


def train(db, loss_at, steps=4):
    """A plain fp16 loop whose loss loss_at(model, step) gives; None: the loop drops the batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for i in range(steps):
            opt.zero_grad()
            loss = loss_at(model, i)
            if loss is None:
                continue
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def forward_loss(model, x):
    with torch.autocast("cpu", dtype=torch.float16):
        return model(x).float().pow(2).mean()


def batch(step, bad_step=None):
    return torch.randn(4, 8) * (OVERFLOW if step == bad_step else 1.0)


def test_a_nan_forward_the_loop_skips_before_backward_is_dropped_at_its_step(tmp_path):
    def guarded(model, step):
        loss = forward_loss(model, batch(step, 2))
        return loss if torch.isfinite(loss) else None

    train(tmp_path / "run.db", guarded, steps=6)
    assert nan_steps(tmp_path / "run.db") == [2]
    assert dropped(tmp_path / "run.db") == [
        (2, "1 forward whose output went NaN/Inf (first at 0) got no backward before the step ended: the loop "
            "dropped the batch")]


def guarded(model, step, bad_step):
    loss = forward_loss(model, batch(step, bad_step))
    return loss if torch.isfinite(loss) else None


def test_a_nan_forward_the_loop_skips_in_its_last_iteration_is_dropped_when_the_run_closes(tmp_path):
    # No step ends after the loop's last batch: the run's end is where it was lost.
    train(tmp_path / "run.db", lambda model, step: guarded(model, step, 3), steps=4)
    assert dropped(tmp_path / "run.db") == [
        (3, "1 forward whose output went NaN/Inf (first at 0) got no backward before the step ended: the loop "
            "dropped the batch")]


def test_a_nan_forward_before_the_training_raised_is_not_called_dropped(tmp_path):
    # The exception, not the loop, left it without a backward.
    def raising(model, step):
        if guarded(model, step, 3) is None:
            raise RuntimeError("data loader failed")
        return forward_loss(model, batch(step))

    try:
        train(tmp_path / "run.db", raising, steps=4)
    except RuntimeError:
        pass
    assert dropped(tmp_path / "run.db") == []


def test_a_nan_forward_whose_loss_the_scaler_skips_is_not_dropped(tmp_path):
    train(tmp_path / "run.db", lambda model, step: forward_loss(model, batch(step, 2)))
    assert nan_steps(tmp_path / "run.db") == [2]
    assert dropped(tmp_path / "run.db") == []


def test_a_nan_forward_among_two_before_one_backward_is_not_dropped(tmp_path):
    # A siamese loss: both forwards' outputs reach the backward.
    train(tmp_path / "run.db", lambda model, step: forward_loss(model, batch(step, 2)) + forward_loss(model, batch(step)))
    assert nan_steps(tmp_path / "run.db") == [2]
    assert dropped(tmp_path / "run.db") == []


def test_a_nan_forward_under_no_grad_inside_the_step_is_not_dropped(tmp_path):
    # A target computed by the same model under no_grad: nothing could backpropagate into it.
    def with_target(model, step):
        loss = forward_loss(model, batch(step))
        with torch.no_grad():
            forward_loss(model, batch(step, 2))
        return loss

    train(tmp_path / "run.db", with_target)
    assert nan_steps(tmp_path / "run.db") == [2]
    assert dropped(tmp_path / "run.db") == []


def test_a_nan_forward_in_eval_mode_with_gradients_on_is_an_evaluation_not_a_dropped_batch(tmp_path):
    # A validation pass without torch.no_grad(): its loss never reaches backward by design.
    def with_validation(model, step):
        if step == 2:
            model.eval()
            forward_loss(model, batch(step, 2))
            model.train()
        return forward_loss(model, batch(step))

    train(tmp_path / "run.db", with_validation)
    assert nan_steps(tmp_path / "run.db") == [2]
    assert dropped(tmp_path / "run.db") == []
    with sqlite3.connect(tmp_path / "run.db") as c:
        assert c.execute("SELECT step, detail FROM events WHERE kind = 'evaluation-nonfinite'").fetchall() == [
            (2, "1 forward whose output went NaN/Inf (first at 0) ran with the model in eval mode and gradients on "
                "(an evaluation without torch.no_grad())")]
