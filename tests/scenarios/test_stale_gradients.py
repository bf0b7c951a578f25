"""A loop that never calls optimizer.zero_grad(): every step adds its gradients to all the
earlier ones until they overflow fp16 and the scale collapses. The report used to blame
the last layer's gradients as beyond fp16's range and tell the user to shrink the loss and
pin the layer to FP32; it names the missing zero_grad() first, and the loop with it is
healthy. And its twin: zero_grad(set_to_none=False) between backward and scaler.step(),
where nothing trains and nothing overflows (with set_to_none=True torch raises)."""
from conftest import rules
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
