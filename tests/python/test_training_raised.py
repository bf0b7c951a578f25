"""A run.db that holds no step says why: the exception the training raised inside
attach()'s with-block, or that ended a program whose handle was still open (event
"training-raised"), or which call the loop never reached."""
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import torch

import ampdiag
from conftest import Tiny


def report_error(cli, db):
    result = subprocess.run([cli, "report", str(db)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout
    return result.stderr.strip()


def backward_only(model):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 16)).float().mean()
    loss.backward()


def raised_inside(db, error):
    """A backward, then `error` raised inside attach()'s with-block (no step recorded)."""
    model = Tiny()
    with pytest.raises(type(error)):
        with ampdiag.attach(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), db=db):
            backward_only(model)
            raise error


def test_an_exception_inside_the_with_block_is_recorded_with_its_first_line(tmp_path):
    db = tmp_path / "raised.db"
    raised_inside(db, RuntimeError("could not create a primitive descriptor\nsecond line"))
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT detail FROM events WHERE kind = 'training-raised'").fetchall() == [
            ("RuntimeError: could not create a primitive descriptor",)]


def test_an_exception_raised_outside_the_models_modules_names_no_module(tmp_path):
    db = tmp_path / "raised.db"
    raised_inside(db, RuntimeError("in the loop's own code"))
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM events WHERE kind = 'training-raised-in'").fetchone() == (0,)


def test_an_exception_raised_in_a_submodules_forward_names_the_innermost_one(tmp_path):
    class Refusing(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("refused")

    model = Tiny()
    model.inner = torch.nn.Sequential(Refusing())
    db = tmp_path / "raised.db"
    with pytest.raises(RuntimeError):
        with ampdiag.attach(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), db=db):
            model.inner(torch.randn(4, 16))
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT detail FROM events WHERE kind = 'training-raised-in'").fetchall() == [
            ("inner.0 (Refusing)",)]


def test_a_run_without_steps_whose_training_raised_is_reported_with_the_exception(tmp_path, ampdiag_cli):
    db = tmp_path / "raised.db"
    raised_inside(db, ValueError("bad batch"))
    assert report_error(ampdiag_cli, db).endswith(
        "holds no steps: before its first step was recorded, the training raised ValueError: bad batch")


def test_an_exception_that_ends_a_program_attached_without_with_is_recorded_and_still_printed(tmp_path, ampdiag_cli):
    # attach() at the top and close() at the end, as the package's docstring writes it: the
    # exception skips close(), and the program ends through sys.excepthook.
    db = tmp_path / "uncaught.db"
    program = textwrap.dedent(f"""
        import sys, torch, ampdiag
        sys.excepthook = lambda kind, error, tb: print("user hook:", kind.__name__, file=sys.stderr)
        model = torch.nn.Linear(4, 1)
        handle = ampdiag.attach(model, torch.amp.GradScaler("cpu"), db={str(db)!r})
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.randn(2, 4)).float().mean()
        raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
        handle.close()
    """)
    ran = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1
    assert ran.stderr.strip().endswith("user hook: RuntimeError")  # the program's own hook still runs
    error = report_error(ampdiag_cli, db)
    assert ("holds no steps: before its first step was recorded, the training raised RuntimeError: could not create a "
            "primitive descriptor for the LSTM forward propagation primitive. ") in error
    assert "run the LSTM in FP32" in error  # raised outside the model's modules: none to name


def test_a_run_without_a_scaler_and_without_steps_names_the_optimizers_step(tmp_path, ampdiag_cli):
    db = tmp_path / "nostep.db"
    model = Tiny()
    with ampdiag.attach(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), db=db):
        backward_only(model)
    assert report_error(ampdiag_cli, db).endswith("holds no steps (the training never reached the optimizer's step())")


def test_a_with_block_that_ends_normally_records_no_exception(tmp_path):
    db = tmp_path / "fine.db"
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdiag.attach(model, optimizer=opt, db=db):
        backward_only(model)
        opt.step()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'training-raised'").fetchone() == (0,)


def scaler_step_refused(db, zero_grad_between: bool):
    """An fp16 step whose scaler.step() torch refuses ("No inf checks were recorded"):
    zero_grad() between the backward and the step, or a step of an optimizer whose
    parameters (a head the loss does not use) no backward reached."""
    model, head = Tiny(), torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters() if zero_grad_between else head.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        with ampdiag.attach(model, scaler, db=db):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().mean()
            scaler.scale(loss).backward()
            if zero_grad_between:
                opt.zero_grad()
            scaler.step(opt)


def test_gradients_set_to_none_between_backward_and_step_give_the_refusal_its_zero_grad_fix(tmp_path, ampdiag_cli):
    db = tmp_path / "cleared.db"
    scaler_step_refused(db, zero_grad_between=True)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'gradients-set-to-none'").fetchone() == (1,)
    error = report_error(ampdiag_cli, db)
    assert "The step's backward reached the optimizer's parameters, and their .grad was None" in error
    assert error.endswith("never between backward and scaler.step().")


def test_an_optimizer_no_backward_reached_is_not_said_to_have_had_its_gradients_set_to_none(tmp_path, ampdiag_cli):
    db = tmp_path / "unreached.db"
    scaler_step_refused(db, zero_grad_between=False)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'gradients-set-to-none'").fetchone() == (0,)
    assert "found no gradient in any of the optimizer's parameters: the backward before it reached none" in \
        report_error(ampdiag_cli, db)
