"""Where the model's input holds NaN, or Inf that reaches a data layer's first argument
unchanged: the argument named as the user wrote the call, nested lists and dicts included;
a mask's -inf, which reaches an attention module, is by design."""
import torch

from ampdiag._tensors import beyond_fp16_in_inputs, inf_in_model_input, nan_in_inputs


def test_a_nan_in_a_dict_batch_names_its_key():
    x = torch.zeros(4, 3)
    x[1, 2] = float("nan")
    assert nan_in_inputs(({"ids": torch.ones(4, dtype=torch.long), "x": x},), {}) == \
        "argument 0['x'] (float32 [4, 3]): 1 NaN of 12 values"


def test_a_nan_in_a_keyword_argument_names_the_keyword():
    y = torch.full((2,), float("nan"), dtype=torch.float16)
    assert nan_in_inputs((torch.zeros(2),), {"target": y}) == "argument 'target' (float16 [2]): 2 NaN of 2 values"


def test_an_infinite_mask_is_not_a_nan_input():
    mask = torch.full((4, 4), float("-inf")).triu(1)
    assert nan_in_inputs((torch.zeros(4, 4), [mask]), {}) is None


def log_power():
    x = torch.full((2, 3), -4.5)  # log power of a quiet frame
    x[0, :2] = float("-inf")  # log(0): a silent one
    return x


def test_minus_inf_features_reaching_a_layer_name_the_models_argument():
    x = log_power()
    assert inf_in_model_input(x, (torch.zeros(1), {"feats": x}), {}) == \
        "argument 1['feats'] (float32 [2, 3]): 2 -Inf of 6 values"


def test_a_view_of_the_models_argument_is_that_argument():
    x = log_power()
    assert inf_in_model_input(x.view(-1), (x,), {}) == "argument 0 (float32 [2, 3]): 2 -Inf of 6 values"


def test_plus_and_minus_inf_are_both_counted():
    x = torch.zeros(4)
    x[1], x[2] = float("inf"), float("-inf")
    assert inf_in_model_input(x, (x,), {}) == "argument 0 (float32 [4]): 1 +Inf and 1 -Inf of 4 values"


def test_inf_the_model_made_itself_is_not_its_inputs():
    made = log_power() * 2.0  # computed inside the model's forward
    assert inf_in_model_input(made, (log_power(),), {}) is None


def test_a_sparse_input_is_passed_over_not_read():
    # Indexing it as a dense tensor would raise inside the model's forward hook.
    values = torch.tensor([float("inf"), 1e6])
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (4,))
    assert nan_in_inputs((sparse,), {}) is None
    assert inf_in_model_input(sparse, (sparse,), {}) is None
    assert beyond_fp16_in_inputs((sparse,), {}) is None
