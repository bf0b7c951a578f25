"""Where the model's input holds NaN: the argument named as the user wrote the call, nested
lists and dicts included; a -inf (a mask passed in) is not NaN."""
import torch

from ampdiag._tensors import nan_in_inputs


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
