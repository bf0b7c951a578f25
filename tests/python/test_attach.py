"""ampdiag.attach() on real torch.amp training loops: it records, it detaches cleanly, and
it changes no number of the training."""
import sqlite3

import pytest
import torch
from torch import nn

import ampdiag
from conftest import Tiny, train


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("fused", [True, False])
def test_training_is_bit_identical_with_the_agent(tmp_path, fused):
    without, skipped, _ = train(25)
    assert skipped > 0  # the comparison covers skipped steps
    with_agent, skipped_with, _ = train(
        25, lambda m, s, o: ampdiag.attach(m, s, db=tmp_path / "run.db", fused_unscale=fused))
    assert skipped_with == skipped
    for a, b in zip(without, with_agent):
        assert torch.equal(bits(a), bits(b))


def test_a_fused_adamw_unscaling_inside_its_step_trains_bit_identically_and_its_skips_are_recorded(tmp_path):
    # AdamW(fused=True) takes the scale and found_inf from scaler.step() and unscales inside its
    # own kernel; torch calls _unscale_grads_ only to look for NaN/Inf, with a scale of 1.
    def fused(params):
        return torch.optim.AdamW(params, lr=1e-3, fused=True)

    without, skipped, _ = train(25, optimizer_factory=fused)
    assert skipped > 0
    db = tmp_path / "run.db"
    with_agent, skipped_with, _ = train(25, lambda m, s, o: ampdiag.attach(m, s, db=db), optimizer_factory=fused)
    assert skipped_with == skipped
    for a, b in zip(without, with_agent):
        assert torch.equal(bits(a), bits(b))
    assert rows(db, "SELECT COUNT(*), SUM(skipped) FROM steps") == [(25, skipped)]


def test_every_step_is_recorded_with_scale_and_skips(tmp_path):
    db = tmp_path / "run.db"
    _, skipped, handle = train(10, lambda m, s, o: ampdiag.attach(m, s, db=db))
    steps = rows(db, "SELECT step, scale_before, scale_after, skipped, loss FROM steps ORDER BY step")
    assert [r[0] for r in steps] == list(range(10))
    assert sum(r[3] for r in steps) == skipped
    assert steps[0][1] == 1e9
    assert all(r[4] is not None for r in steps)
    assert handle.status["steps"] == 10


def test_last_step_skipped_tells_what_torch_does_not(tmp_path):
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1e30)
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db") as handle:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 16)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert handle.last_step_skipped
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 16)).float().mean()
        scaler.scale(loss * 0).backward()
        scaler.step(optimizer)
        scaler.update()
        assert not handle.last_step_skipped


def test_gradient_and_activation_statistics_are_recorded_in_order(tmp_path):
    db = tmp_path / "run.db"
    train(2, lambda m, s, o: ampdiag.attach(m, s, db=db, activation_every=1))
    layers = dict(rows(db, "SELECT id, name FROM layers"))
    assert set(layers.values()) == {"a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"}
    order = {layers[i]: o for i, o in rows(db, "SELECT layer_id, bwd_order FROM grad_stats WHERE step = 1")}
    assert order["c.weight"] < order["b.weight"] < order["a.weight"]  # backward runs from the loss
    modules = [p for (p,) in rows(db, "SELECT path FROM modules ORDER BY id")]
    assert modules == ["a", "b", "c"]
    acts = rows(db, "SELECT fwd_order, module_id FROM act_stats WHERE step = 1 ORDER BY fwd_order")
    assert [m for _, m in acts] == [0, 1, 2]


def test_outputs_get_full_statistics_on_one_step_in_activation_every_and_a_nonfinite_one_on_any(tmp_path):
    db = tmp_path / "run.db"
    blow_up = [False]

    class Blows(nn.Module):  # a finite output, or +Inf in fp16 on the steps the test says
        def forward(self, x):
            return x * (1e5 if blow_up[0] else 1.0)

    model = nn.Sequential(nn.Linear(16, 16), Blows(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.full((4, 16), 1.0), torch.randn(4, 1)
    with ampdiag.attach(model, scaler, db=db, activation_every=3, replay=False):
        for step in range(8):
            blow_up[0] = step == 4
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    got = rows(db, "SELECT a.step, m.path, a.inf > 0 OR a.nan > 0 FROM act_stats a JOIN modules m ON m.id = a.module_id "
                   "ORDER BY a.step, a.fwd_order")
    # Steps 0, 3, 6: every output. Step 4: only the outputs that held NaN/Inf, from the first on.
    assert [(s, p) for s, p, _ in got if s != 4] == [(s, p) for s in (0, 3, 6) for p in ("0", "1", "2")]
    assert [(p, bad) for s, p, bad in got if s == 4] == [("1", 1), ("2", 1)]
    assert rows(db, "SELECT value FROM meta WHERE key = 'activation_every'") == [("3",)]


def test_outputs_off_the_hooks_fast_path_get_the_same_statistics_as_torch_computes(tmp_path):
    # The hook reads a contiguous host output inline; a sliced (non-dense), float64 or tuple
    # output goes through the helpers. Each must give torch's own abs-max and NaN count.
    seen = {}

    def watch(name):
        def hook(module, args, output):
            t = (output[1] if isinstance(output, tuple) else output).detach().float()
            seen.setdefault(name, []).append((float(t.nan_to_num(nan=0.0).abs().max()), int(t.isnan().sum())))
        return hook

    class Sliced(nn.Module):  # every other column (no dense block to read in place); the others large
        def forward(self, x):
            y = x * 3.0
            y[:, 1::2] = 1000.0
            return y[:, ::2]

    class Double(nn.Module):  # float64, which the engine does not read: a float32 copy
        def forward(self, x):
            out = x.double() * 3.0
            out[0, 0] = float("nan")
            return out

    class Pair(nn.Module):  # a tuple: its first floating-point tensor
        def forward(self, x):
            return torch.arange(3), x - 7.0

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.sliced, self.wide, self.pair = nn.Linear(16, 16), Sliced(), Double(), Pair()

        def forward(self, x):
            h = self.lin(x)
            self.wide(h)
            return self.pair(self.sliced(h))[1].float().sum(1, keepdim=True)

    def watched_model():
        model = Model()
        for name in ("sliced", "wide", "pair"):
            getattr(model, name).register_forward_hook(watch(name))
        return model

    db = tmp_path / "run.db"
    train(2, lambda m, s, o: ampdiag.attach(m, s, db=db, activation_every=1, replay=False), model_factory=watched_model)
    got = rows(db, "SELECT m.path, a.absmax, a.nan FROM act_stats a JOIN modules m ON m.id = a.module_id "
                   "WHERE m.path != 'lin' ORDER BY a.step, a.fwd_order")
    expected = [(name, *seen[name][step]) for step in range(2) for name in ("wide", "sliced", "pair")]
    assert [(p, n) for p, _, n in got] == [(p, n) for p, _, n in expected]
    assert [a for _, a, _ in got] == pytest.approx([a for _, a, _ in expected], rel=1e-6)


def test_fp16_gradients_are_refused_at_unscale_as_torchs_scaler_refuses_them(tmp_path):
    # FP16 parameters leave the agent's gradient fast path: torch's own unscale_ raises.
    torch.manual_seed(0)
    model = nn.Linear(8, 1).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db"):
        scaler.scale(model(torch.randn(4, 8, dtype=torch.float16)).float().sum()).backward()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            scaler.step(optimizer)


def test_a_data_parallel_replica_is_recorded_as_the_module_it_replicates(tmp_path):
    # DataParallel runs every forward on replicas carrying the watched modules' hooks
    # (torch marks them _is_replica). Unlike a deep copy (an EMA), a replica is the module.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, scaler, db=db):
        replica = model[0]._replicate_for_data_parallel()  # what replicate() does, on one device
        for name, param in model[0].named_parameters():
            setattr(replica, name, param * 1)  # the replica's copy, in the graph back to the parameter
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model[1](replica(torch.randn(4, 8))).float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    recorded = rows(db, "SELECT m.path FROM act_stats a JOIN modules m ON m.id = a.module_id ORDER BY a.fwd_order")
    assert [p for (p,) in recorded] == ["0", "1"]


def test_an_evaluation_under_inference_mode_runs_while_attached(tmp_path):
    # Inference tensors have no version counter, which the forward hook reads.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 1))  # a container returning its child's output
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db"):
        for _ in range(2):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
                assert torch.isfinite(model(torch.randn(4, 8))).all()


def test_modules_whose_output_is_bounded_by_their_input_get_no_hook(tmp_path):
    def model():
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.LeakyReLU(0.1),
                             nn.LeakyReLU(5.0), nn.Linear(16, 1))

    db = tmp_path / "run.db"
    train(2, lambda m, s, o: ampdiag.attach(m, s, db=db), model_factory=model)
    # ReLU, GELU and a LeakyReLU of slope <= 1 cannot make a value larger or non-finite; a
    # slope of 5 can.
    assert [p for (p,) in rows(db, "SELECT path FROM modules ORDER BY id")] == ["0", "2", "5", "6"]


def test_dropouts_with_p_zero_get_no_hook_and_other_dropouts_do(tmp_path):
    def model():
        return nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.0), nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 1))

    db = tmp_path / "run.db"
    train(2, lambda m, s, o: ampdiag.attach(m, s, db=db), model_factory=model)
    # p = 0 returns the input itself; p > 0 scales by 1 / (1 - p) and can overflow.
    assert [p for (p,) in rows(db, "SELECT path FROM modules ORDER BY id")] == ["0", "2", "3", "4"]


def test_detach_restores_the_scaler_and_removes_every_hook(tmp_path):
    model = Tiny()
    scaler = torch.amp.GradScaler("cpu")
    handle = ampdiag.attach(model, scaler, db=tmp_path / "run.db")
    assert "update" in scaler.__dict__
    handle.close()
    assert not {"update", "scale", "_unscale_grads_"} & set(scaler.__dict__)
    assert all(not m._forward_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())
    handle.close()  # idempotent
    again = ampdiag.attach(model, scaler, db=tmp_path / "again.db")  # attachable again
    again.close()


def test_context_manager_finishes_the_run(tmp_path):
    db = tmp_path / "run.db"
    with ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=db):
        pass
    assert rows(db, "SELECT COUNT(*) FROM meta WHERE key = 'finished_at'") == [(1,)]


def test_bf16_without_a_scaler_still_localises_nonfinite_values(tmp_path, report):
    class Exploding(Tiny):
        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.c(torch.relu(self.b(h * 1e38 * 10)))  # beyond bf16's (and fp32's) range

    db = tmp_path / "bf16.db"
    torch.manual_seed(0)
    model = Exploding()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdiag.attach(model, optimizer=optimizer, db=db) as handle:
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 16)).float().mean()
            loss.backward()
            optimizer.step()
    assert rows(db, "SELECT value FROM meta WHERE key = 'amp_dtype'") == [("bfloat16",)]
    assert rows(db, "SELECT COUNT(*) FROM steps WHERE found_inf = 1") == [(3,)]
    code, rep = report(db)
    assert code == 1
    first = rep["findings"][0]
    # b only receives the Inf (its FP32 replay is still Inf): the model's own forward makes it.
    assert first["rule"] == "forward-nonfinite" and first["module"] == ""
    assert "showed it first but only received it" in first["evidence"]
    assert not any("pin_fp32(model.b)" in s["python"] for f in rep["findings"] for s in f["suggestions"])


def test_frozen_unused_and_shared_parameters(tmp_path):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.unused = nn.Linear(8, 8)
            self.out = nn.Linear(8, 10, bias=False)
            self.out.weight = self.embed.weight  # tied

        def forward(self, ids):
            return self.out(self.frozen(self.embed(ids)))

    db = tmp_path / "run.db"
    model = Odd()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(2):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.tensor([1, 2, 3])).float().logsumexp(-1).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    names = {n: t for n, t in rows(db, "SELECT name, trainable FROM layers")}
    assert "out.weight" not in names and "embed.weight" in names  # the tied weight, once
    assert names["frozen.weight"] == 0
    kinds = {k for (k,) in rows(db, "SELECT kind FROM events")}
    assert {"shared-parameter", "frozen-parameters"} <= kinds
    with_stats = {n for (n,) in rows(db, "SELECT DISTINCT l.name FROM grad_stats g JOIN layers l ON l.id = g.layer_id")}
    assert with_stats == {"embed.weight"}  # frozen: no grad; unused: no grad this step


def test_pins_run_a_module_in_fp32_while_attached(tmp_path):
    model = Tiny()
    with ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "run.db", pins=["b"]):
        with torch.autocast("cpu", dtype=torch.float16):
            assert model.b(torch.randn(2, 32)).dtype == torch.float32
            assert model.a(torch.randn(2, 16)).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.float16):
        assert model.b(torch.randn(2, 32)).dtype == torch.float16  # unpinned at close


def test_modules_pinned_by_pins_or_by_the_user_before_attach_are_recorded(tmp_path):
    # The analyzer offers no pin the run already had.
    def attach(model, scaler, opt):
        ampdiag.pin_fp32(model.a)
        return ampdiag.attach(model, scaler, db=tmp_path / "run.db", pins=["b"])

    train(2, attach)
    assert sorted(rows(tmp_path / "run.db", "SELECT detail FROM events WHERE kind = 'pinned-fp32'")) == [("a",), ("b",)]


def test_pin_fp32_casts_inputs_and_disables_autocast():
    layer = ampdiag.pin_fp32(nn.Linear(4, 4))
    with torch.autocast("cpu", dtype=torch.float16):
        assert layer(torch.randn(2, 4).half()).dtype == torch.float32
    ampdiag.unpin_fp32(layer)
    with torch.autocast("cpu", dtype=torch.float16):
        assert layer(torch.randn(2, 4)).dtype == torch.float16


# --- misuse: a clear Python exception, never a crash -----------------------------------


def test_attaching_twice_is_refused(tmp_path):
    model, scaler = Tiny(), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=tmp_path / "a.db"):
        with pytest.raises(RuntimeError, match="already has an ampdiag handle"):
            ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=tmp_path / "b.db")
        with pytest.raises(RuntimeError, match="already has an ampdiag handle"):
            ampdiag.attach(Tiny(), scaler, db=tmp_path / "c.db")


def test_a_second_model_on_the_same_scaler_is_told_to_attach_one_module_dict(tmp_path):
    # torch's AMP example with two models and one scaler: one run, one handle.
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(Tiny(), scaler, db=tmp_path / "a.db"):
        with pytest.raises(RuntimeError, match=r"attach one torch.nn.ModuleDict holding them all"):
            ampdiag.attach(Tiny(), scaler, db=tmp_path / "b.db")


def test_a_model_on_an_unsupported_device_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'meta' device"):
        ampdiag.attach(Tiny().to("meta"), torch.amp.GradScaler("cpu"), db=tmp_path / "run.db")


def test_an_unwritable_db_path_is_refused_and_nothing_is_attached(tmp_path):
    model, scaler = Tiny(), torch.amp.GradScaler("cpu")
    with pytest.raises(ampdiag.RunDbError, match="no-such-dir"):
        ampdiag.attach(model, scaler, db=tmp_path / "no-such-dir" / "run.db")
    assert "update" not in scaler.__dict__
    assert all(not m._forward_hooks for m in model.modules())


def test_an_existing_db_is_not_overwritten_unless_asked(tmp_path):
    db = tmp_path / "run.db"
    ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=db).close()
    with pytest.raises(ampdiag.RunDbError, match="already exists"):
        ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=db)
    ampdiag.attach(Tiny(), torch.amp.GradScaler("cpu"), db=db, overwrite=True).close()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"every": 0}, ValueError, "every"),
    ({"activation_every": 0}, ValueError, "activation_every"),
    ({"queue_capacity": 3}, ValueError, "queue_capacity"),
    ({"pins": ["no.such"]}, ValueError, "no module 'no.such'"),
    ({"scaler": None}, ValueError, "pass scaler="),
    ({"scaler": "fp16"}, TypeError, "GradScaler"),
])
def test_bad_arguments_are_refused(tmp_path, kwargs, error, match):
    args = dict(scaler=torch.amp.GradScaler("cpu"), db=tmp_path / "run.db")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ampdiag.attach(Tiny(), **args)


def test_a_model_that_is_not_a_module_is_refused(tmp_path):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ampdiag.attach(lambda x: x, torch.amp.GradScaler("cpu"), db=tmp_path / "run.db")


def test_permuted_outputs_are_read_in_place_with_the_same_statistics():
    from ampdiag import _ampdiag
    from ampdiag._tensors import directly_readable as _directly_readable, readable_view as _readable_view

    base = torch.randn(4, 8, 16).half()
    base[1, 2, 3] = float("inf")
    permuted = base.transpose(0, 2)  # a transpose: non-contiguous, but one dense block
    assert not permuted.is_contiguous() and _directly_readable(permuted)
    assert _readable_view(permuted) is permuted
    strided = base[:, ::2]  # every other row: gaps, so it is copied
    assert not _directly_readable(strided)
    a = _ampdiag.tensor_stats(permuted.data_ptr(), permuted.numel(), 1)
    b = _ampdiag.tensor_stats(base.contiguous().data_ptr(), base.numel(), 1)
    assert a == b and a["inf"] == 1


@pytest.mark.parametrize("poisoned", [False, True])
def test_attach_records_whether_the_parameters_were_finite(tmp_path, poisoned):
    # NaN/Inf found before any optimizer step came with the model only where attach() saw it.
    model = nn.Linear(4, 2)
    if poisoned:
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, torch.amp.GradScaler("cpu"), db=db):
        pass
    assert rows(db, "SELECT value FROM meta WHERE key = 'parameters_at_attach'") == [
        ("nonfinite" if poisoned else "finite",)]
