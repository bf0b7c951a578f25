"""A block wrapped by torch's checkpoint_wrapper (as FSDP1 users wrap their blocks; FSDP1
itself is tested on two ranks in tests/scenarios/test_fsdp1.py): the run names its layers
and modules as the unwrapped model does, as the checkpoint's state_dict() does, without
`_checkpoint_wrapped_module`; the wrapped block itself, not its wrapper, holds the name,
and a pin given that name reaches it through the wrapper."""
import sqlite3

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import ampdiag


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc(x)))


def train(db, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), checkpoint_wrapper(Block()), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, opt, db=db, **options):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return sqlite3.connect(db)


def test_a_checkpoint_wrapped_blocks_layers_are_named_without_the_wrapper(tmp_path):
    run = train(tmp_path / "run.db")
    assert [row for row in run.execute("SELECT name, module_path, module_type FROM layers ORDER BY id")] == [
        ("0.weight", "0", "Linear"), ("0.bias", "0", "Linear"), ("1.fc.weight", "1.fc", "Linear"),
        ("1.fc.bias", "1.fc", "Linear"), ("1.fc2.weight", "1.fc2", "Linear"), ("1.fc2.bias", "1.fc2", "Linear"),
        ("2.weight", "2", "Linear"), ("2.bias", "2", "Linear")]


def test_a_checkpoint_wrapped_block_is_watched_once_under_its_own_type(tmp_path):
    run = train(tmp_path / "run.db")
    assert dict(run.execute("SELECT path, module_type FROM modules")) == {
        "0": "Linear", "1.fc": "Linear", "1.fc2": "Linear", "1": "Block", "2": "Linear"}


def test_a_pin_by_the_unwrapped_name_reaches_the_wrapped_block(tmp_path):
    run = train(tmp_path / "run.db", pins=("1.fc",))
    assert run.execute("SELECT detail FROM events WHERE kind = 'pinned-fp32'").fetchall() == [("1.fc",)]


def test_a_pin_on_the_wrapper_itself_is_recorded_under_the_wrapped_name(tmp_path):
    # pins=("1",) reaches the CheckpointWrapper, which holds the name "1" without being the
    # module the run watches under it.
    run = train(tmp_path / "run.db", pins=("1",))
    assert run.execute("SELECT detail FROM events WHERE kind = 'pinned-fp32'").fetchall() == [("1",)]
