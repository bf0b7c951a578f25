"""attach() on a torch.compile'd model: the run names the modules as the uncompiled model
does, torch.compile never traces ampdiag's own code, and the training is the same as
without ampdiag. A model compiled after attach() is not watched, and the report says so.

backend="eager" runs Dynamo, which is where the hooks meet the compiler, without inductor's
C++ compile (minutes on a small machine)."""
import os
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo import convert_frame

import ampdiag
from conftest import train


class Overflowing(nn.Module):
    """`big` overflows fp16 in forward on the steps whose batch is 30 times larger."""

    def __init__(self):
        super().__init__()
        self.fc1, self.big, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        with torch.no_grad():
            self.big.weight.mul_(3000.0)

    def forward(self, x):
        return self.head(torch.relu(self.big(torch.relu(self.fc1(x)))))


def compiled(module):
    torch._dynamo.reset()  # each test compiles from scratch: no cache entries from another
    return torch.compile(module, backend="eager")


def train_overflowing(db, compiled_when, steps=6):
    """compiled_when: "before" attach(), "in place" before it (Module.compile()), or "after"."""
    torch.manual_seed(0)
    model = Overflowing()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    if compiled_when == "before":
        model = compiled(model)
    elif compiled_when == "in place":
        torch._dynamo.reset()
        model.compile(backend="eager")
    handle = ampdiag.attach(model, scaler, db=db)
    if compiled_when == "after":
        model = compiled(model)
    for step in range(steps):
        x = torch.randn(8, 16) * (30 if step % 2 else 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    handle.close()


def ampdiag_frames_compiled(db, compiled_when):
    """The code objects of ampdiag's package that Dynamo compiled while training."""
    frames, package = [], os.path.dirname(ampdiag.__file__) + os.sep

    def seen(code, new_code):
        if code.co_filename.startswith(package):
            frames.append(f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})")

    hook = convert_frame.register_bytecode_hook(seen)
    try:
        train_overflowing(db, compiled_when)
    finally:
        hook.remove()
    return frames


@pytest.mark.parametrize("compiled_when", ["before", "in place"])
def test_a_compiled_model_is_named_and_diagnosed_as_the_model_it_compiled(tmp_path, report, compiled_when):
    db = tmp_path / "run.db"
    train_overflowing(db, compiled_when)
    _, rep = report(db)
    first = rep["findings"][0]
    assert (first["rule"], first["module"], first["confirmation"]) == ("forward-nonfinite", "big", "confirmed")
    assert not any("_orig_mod" in str(f) for f in rep["findings"])


@pytest.mark.parametrize("compiled_when", ["before", "in place"])
def test_torch_compile_never_traces_the_hooks_of_a_model_compiled_before_attach(tmp_path, compiled_when):
    # Traced, they warned at every call into the extension and were recompiled for each
    # module path and each value of the agent's flags.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        frames = ampdiag_frames_compiled(tmp_path / "run.db", compiled_when)
    assert frames == []
    assert [str(w.message) for w in caught if "ampdiag" in str(w.message)] == []


def test_a_model_compiled_after_attach_is_not_watched_and_the_report_says_to_attach_after(tmp_path, report):
    # Its hooks, traced, do nothing but say so: no warning, none of the agent's code in the
    # graph, and the training runs as compiled (moving them outside the graph then would
    # break a fullgraph=True compile mid-run).
    db = tmp_path / "run.db"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        frames = ampdiag_frames_compiled(db, "after")
    assert {frame.split(" ")[0] for frame in frames} <= {"hook"}
    assert [str(w.message) for w in caught if "ampdiag" in str(w.message)] == []
    _, rep = report(db)
    [forward] = [f for f in rep["findings"] if f["rule"] == "forward-nonfinite"]
    assert forward["module"] == ""
    assert "compiled with torch.compile after attach()" in forward["evidence"]
    assert "ampdiag.attach(model, scaler)" in forward["suggestions"][0]["python"]


def test_a_compiled_model_trains_the_same_with_ampdiag(tmp_path):
    params, skipped, _ = train(8, model_factory=lambda: compiled(nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                                                               nn.Linear(32, 1))))
    watched, watched_skipped, _ = train(8, lambda m, s, o: ampdiag.attach(m, s, db=tmp_path / "run.db"),
                                        model_factory=lambda: compiled(nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                                                                     nn.Linear(32, 1))))
    assert skipped > 0 and watched_skipped == skipped
    assert all(torch.equal(a, b) for a, b in zip(params, watched))


def test_a_compiled_model_can_be_attached_again_after_close(tmp_path):
    model = compiled(Overflowing())
    scaler = torch.amp.GradScaler("cpu")
    first = ampdiag.attach(model, scaler, db=tmp_path / "first.db")
    first.close()
    second = ampdiag.attach(model, scaler, db=tmp_path / "second.db")  # the first handle is still alive
    second.close()


@pytest.mark.parametrize("fullgraph", [True, False])
def test_fullgraph_is_read_from_torch_2_5s_compiled_wrapper_too(fullgraph):
    # torch 2.5 keeps the flag only on the frame converter it chose, not on the wrapper's
    # context (the refusal below let such a model through: scripts/test-floor found it).
    from types import SimpleNamespace
    from ampdiag._forward import compiled_fullgraph

    converter = SimpleNamespace(_one_graph=True) if fullgraph else SimpleNamespace()
    wrapper = nn.Linear(2, 2)
    wrapper.dynamo_ctx = SimpleNamespace(callback=SimpleNamespace(_torchdynamo_orig_callable=converter))
    assert compiled_fullgraph(wrapper) is fullgraph


def test_a_fullgraph_model_with_activations_is_refused_with_the_way_out(tmp_path):
    torch._dynamo.reset()
    model = torch.compile(Overflowing(), backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"fullgraph=True.*activations=False"):
        ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "run.db")
    assert not (tmp_path / "run.db").exists()
    ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "run.db", activations=False).close()
