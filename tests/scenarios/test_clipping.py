"""Gradient clipping with a GradScaler: clip_grad_norm_ before scaler.unscale_() clips the
gradients while they are still multiplied by the loss scale. Nothing goes NaN/Inf and
torch raises nothing; every update is cut to max_norm / scale and the loss hardly falls.
The report names it, and its fix (unscale first) trains the same loop. The same for a clip
of one part of the model (its first layer) only: that part barely trains, and for
clip_grad_value_, which cuts every scaled value to the clip value."""
import torch

from conftest import rules
from regression_loop import regression_loop


def clipping_loop(db, unscale_first, steps=60, part=None, by_value=False):
    """The regression loop, clipping to max_norm 1 the gradients of every parameter, or of
    the module `part(model)` only, or each value to ±1 (`by_value`); returns its last loss."""

    def clip(scaler, opt, model):
        if unscale_first:
            scaler.unscale_(opt)
        if by_value:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_((part(model) if part else model).parameters(), 1.0)

    return regression_loop(db, steps, between=clip)[0]


def test_clipping_before_unscale_is_named_with_the_clip_and_the_order_that_fixes_it(tmp_path, verdict):
    clipping_loop(tmp_path / "clip.db", unscale_first=False)
    code, rep = verdict(tmp_path / "clip.db")
    assert code == 1
    assert rules(rep, "error") == [("clip-before-unscale", "")]
    finding = rep["findings"][0]
    assert "max_norm=1)" in finding["evidence"]
    assert "scaler.unscale_(optimizer)\ntorch.nn.utils.clip_grad_norm_" in finding["suggestions"][0]["python"].replace(
        "  # the gradients' true values, before the clip", "")


def test_unscaling_before_the_clip_as_the_report_says_is_healthy_and_trains(tmp_path, verdict):
    wrong = clipping_loop(tmp_path / "wrong.db", unscale_first=False)
    right = clipping_loop(tmp_path / "right.db", unscale_first=True)
    code, rep = verdict(tmp_path / "right.db")
    assert code == 0, rep["findings"]
    assert "clip-before-unscale" not in [rule for rule, _ in rules(rep)]
    assert right < wrong / 5  # the clipped-while-scaled updates barely moved the model


def test_clipping_one_part_of_the_model_before_unscale_names_that_part(tmp_path, verdict):
    clipping_loop(tmp_path / "part.db", unscale_first=False, part=lambda model: model[0])
    code, rep = verdict(tmp_path / "part.db")
    assert code == 1
    assert rules(rep, "error") == [("clip-before-unscale", "0")]
    finding = rep["findings"][0]
    assert "the total norm of 0's 2 gradients was 1 (within 0.01 %)" in finding["evidence"]
    assert "torch.nn.utils.clip_grad_norm_(model[0].parameters(), max_norm=1)" in finding["suggestions"][0]["python"]


def test_clipping_one_part_after_unscale_is_healthy(tmp_path, verdict):
    clipping_loop(tmp_path / "part.db", unscale_first=True, part=lambda model: model[0])
    code, rep = verdict(tmp_path / "part.db")
    assert code == 0, rep["findings"]
    assert "clip-before-unscale" not in [rule for rule, _ in rules(rep)]


def test_clipping_by_value_before_unscale_is_named_with_clip_grad_value(tmp_path, verdict):
    # It used to be read as clip_grad_norm_ of the last layer, whose norm the bound pins too.
    clipping_loop(tmp_path / "value.db", unscale_first=False, by_value=True)
    code, rep = verdict(tmp_path / "value.db")
    assert code == 1
    assert rules(rep, "error") == [("clip-before-unscale", "")]
    assert "clip_grad_value_(..., clip_value=1)" in rep["findings"][0]["evidence"]
    assert "torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=1)" in rep["findings"][0]["suggestions"][0]["python"]


def test_clipping_by_value_after_unscale_is_healthy_and_trains(tmp_path, verdict):
    wrong = clipping_loop(tmp_path / "wrong.db", unscale_first=False, by_value=True)
    right = clipping_loop(tmp_path / "right.db", unscale_first=True, by_value=True)
    code, rep = verdict(tmp_path / "right.db")
    assert code == 0, rep["findings"]
    assert right < wrong / 2
