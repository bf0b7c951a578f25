"""Evaluations between the training steps (a validation pass in eval mode under no_grad or
inference_mode): not recorded as training, and their NaN/Inf a warning of its own
(rule evaluation-overflow), never a mask's -inf."""
import torch
from torch import nn

import ampdiag
from conftest import amp_step, rows
from fp16_loop import fp16_loop


def evaluated_between_steps(tmp_path, evaluate, steps=20):
    """fp16_loop with `evaluate(model, x)` in eval mode under no_grad and fp16 autocast before
    every 5th step; asserts that the activation rows are the loop's without it. Returns the
    run.db."""
    def between_steps(step, model, x):
        if step % 5 == 0:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                evaluate(model, x)
            model.train()

    db, plain = tmp_path / "evaluated.db", tmp_path / "plain.db"
    fp16_loop(db, steps=steps, between_steps=between_steps)
    fp16_loop(plain, steps=steps)
    query = "SELECT step, fwd_order, module_id, absmax FROM act_stats ORDER BY step, fwd_order"
    assert rows(db, query) == rows(plain, query)
    return db


def test_a_validation_pass_between_steps_is_not_recorded_as_training_and_its_overflow_is_a_warning(tmp_path, verdict):
    # Every 5 steps the loop evaluates under no_grad; its inputs overflow fp16 in the first
    # layer (an eval-only problem). Training is healthy: nothing may be blamed on a
    # training step, and the full-statistics steps hold the training forward's rows only.
    # The evaluation's NaN/Inf is a warning of its own, naming its first module from the
    # second such evaluation on.
    def validate(model, x):
        assert not torch.isfinite(model(x * 1e5)).all()

    db = evaluated_between_steps(tmp_path, validate)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    warned = [(f["rule"], f["severity"], f["module"]) for f in rep["findings"] if f["severity"] != "info"]
    assert warned == [("evaluation-overflow", "warning", "a")]
    assert "in 4 evaluations between the training steps" in rep["findings"][0]["evidence"]


def test_a_part_of_the_model_the_loop_evaluates_itself_in_eval_mode_is_not_recorded_as_training(tmp_path, verdict):
    # The model in eval mode under no_grad is an evaluation, whether the loop calls the model
    # or one of its parts (here the first layer, on inputs that overflow it).
    def validate_part(model, x):
        assert not torch.isfinite(model.a(x * 1e5)).all()

    code, rep = verdict(evaluated_between_steps(tmp_path, validate_part, steps=8))
    assert code == 0, rep["findings"]


def test_the_same_validation_in_bfloat16_as_the_report_says_is_finite_and_adds_no_finding(tmp_path, verdict):
    # The report's second fix, under inference_mode this time (the agent reads its tensors
    # without a version counter): finite, so nothing to say about the evaluation.
    def validate(step, model, x):
        if step % 5 == 0:
            model.eval()
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.isfinite(model(x * 1e5)).all()
            model.train()

    db = tmp_path / "val_bf16.db"
    fp16_loop(db, steps=20, between_steps=validate)
    code, rep = verdict(db)
    assert code == 0 and not [f for f in rep["findings"] if f["rule"] == "evaluation-overflow"]


class MaskedLogits(nn.Module):
    """A constrained decoder's head: the classes it may not emit get -inf logits, by design."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
        self.register_buffer("allowed", torch.arange(10) < 7)

    def forward(self, x):
        return self.body(x).masked_fill(~self.allowed, float("-inf"))


def test_a_validation_whose_logits_hold_a_masks_minus_inf_by_design_adds_no_finding(tmp_path, verdict):
    # -inf is what the mask writes, in training and validation alike: no overflow.
    db = tmp_path / "masked.db"
    torch.manual_seed(0)
    model = MaskedLogits()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with ampdiag.attach(model, scaler, db=db):
        for step in range(8):
            amp_step(opt, scaler, lambda: nn.functional.cross_entropy(
                model(torch.randn(32, 16, generator=g)).float(), torch.randint(0, 7, (32,), generator=g)))
            if step % 3 == 0:
                model.eval()
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                    assert torch.isneginf(model(torch.randn(64, 16, generator=g))).any()
                model.train()
    code, rep = verdict(db)
    assert code == 0 and not [f for f in rep["findings"] if f["rule"] == "evaluation-overflow"], rep["findings"]
