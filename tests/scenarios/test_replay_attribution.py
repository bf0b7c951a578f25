"""The FP32 replay: it never changes what the model computes or holds, a replay that
raises is unconfirmed (never escalated), and a NaN/Inf made by a parent's own code is
blamed on the parent, never on the child that only received it."""
import torch
from torch import nn

import ampdiag
from conftest import rows


class KvCache:
    """A transformers-style cache object: every call appends to it (use_cache=True)."""

    def __init__(self):
        self.keys = []

    def append(self, k):
        self.keys.append(k)
        return torch.cat(self.keys, dim=1)


class CachedAttention(nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.q, self.k, self.gain = nn.Linear(16, 16), nn.Linear(16, 16), gain

    def forward(self, x, cache=None):
        k = self.k(x)
        keys = cache.append(k) if cache is not None else k
        scores = self.q(x) @ keys.transpose(1, 2) * self.gain  # overflows fp16 when gain is huge
        return scores.softmax(-1) @ keys


class Block(nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.attn, self.mlp = CachedAttention(gain), nn.Linear(16, 16)

    def forward(self, x, cache=None):
        x = x + self.attn(x, cache=cache)
        return x + self.mlp(x)


class Transformer(nn.Module):
    def __init__(self, gain=1.0):
        super().__init__()
        self.h = nn.ModuleList([Block(1.0), Block(gain)])
        self.head = nn.Linear(16, 1)

    def forward(self, x, caches):
        for block, cache in zip(self.h, caches):
            x = block(x, cache=cache)
        return self.head(x).mean()


def cached_run(db, gain, attach):
    torch.manual_seed(0)
    model = Transformer(gain)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    shapes, outputs = [], []
    handle = ampdiag.attach(model, scaler, db=db) if attach else None
    for step in range(4):
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(step))
        caches = [KvCache(), KvCache()]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, caches)
        shapes.append([tuple(t.shape) for c in caches for t in c.keys])
        outputs.append(loss.detach().clone())
        scaler.scale(loss.float()).backward()
        scaler.step(opt)
        scaler.update()
    if handle:
        handle.close()
    return shapes, outputs, [p.detach().clone() for p in model.parameters()]


def test_a_replay_never_changes_the_cache_the_model_holds_or_its_outputs(tmp_path):
    plain = cached_run(None, 3e4, attach=False)
    watched = cached_run(tmp_path / "kv.db", 3e4, attach=True)
    assert watched[0] == plain[0]  # every cache got exactly one append per call
    assert all(torch.equal(a, b, ) or (a.isnan().all() and b.isnan().all()) for a, b in zip(watched[1], plain[1]))
    assert all(torch.equal(a, b) for a, b in zip(watched[2], plain[2]))


def fp16_steps(model, db, make_batch, loss_fn, steps=3):
    """A plain fp16 loop with ampdiag attached: forward under autocast, the real GradScaler."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(make_batch()).float())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_a_module_taking_a_cache_is_replayed_on_a_copy_made_before_its_next_call(tmp_path, verdict):
    db = tmp_path / "kv.db"
    cached_run(db, 3e4, attach=True)
    replays = rows(db, "SELECT module, outcome FROM replays ORDER BY id")
    assert replays[0] == ("h.1.attn", "finite")  # its FP32 replay, on the inputs as they were, is finite
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"], first["confirmation"]) == (1, "forward-nonfinite", "h.1.attn",
                                                                             "confirmed")


def test_a_replay_that_raises_is_unconfirmed_and_never_escalates(tmp_path, verdict):
    class Fragile(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if not torch.is_autocast_enabled("cpu"):
                raise RuntimeError("this module only runs under autocast")
            return self.lin(x) * 1e6  # overflows fp16

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(Fragile())
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.block(x))

    torch.manual_seed(0)
    model = Outer()
    db = tmp_path / "fragile.db"
    fp16_steps(model, db, lambda: torch.ones(4, 8), lambda out: out.mean())
    assert model.block[0].calls == 3  # the replay ran on a copy: the model's own module ran once per step
    assert rows(db, "SELECT module, outcome FROM replays") == [("block.0", "unconfirmed")]
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (first["rule"], first["module"], first["confirmation"]) == ("forward-nonfinite", "block.0", "unconfirmed")
    assert "only runs under autocast" in first["evidence"]


def test_a_nan_made_in_the_parents_own_code_names_the_parent_not_the_child(tmp_path, verdict):
    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, x):
            return torch.relu(self.bn2(self.conv2(x) * 2e5))  # the product overflows fp16 in the block's own code

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.layer1, self.fc = nn.Conv2d(3, 4, 3, padding=1), ResBlock(), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.layer1(self.stem(x)).mean((2, 3)))

    torch.manual_seed(0)
    model = Net()
    db = tmp_path / "res.db"
    fp16_steps(model, db, lambda: torch.randn(2, 3, 8, 8),
               lambda out: nn.functional.cross_entropy(out, torch.tensor([0, 1])))
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"], first["confirmation"]) == (1, "forward-nonfinite", "layer1",
                                                                             "confirmed")
    assert first["title"].endswith("in its own code, between layer1.conv2 and layer1.bn2")  # the `* 2e5`
    snippets = [s["python"] for f in rep["findings"] for s in f["suggestions"]]
    assert not any("bn2" in s for s in snippets)  # the replay disproved pinning bn2
    assert any("ampdiag.pin_fp32(model.layer1)" in s for s in snippets)


def test_a_parent_returning_its_childs_output_is_listed_without_rows_and_still_blamed_for_its_own_code(
        tmp_path, verdict):
    class Amplified(nn.Module):
        """Its own code makes the Inf (x * 1e5 in the autocast dtype); its child only
        receives it and returns the tensor the parent returns."""

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
            return self.proj(x.to(dtype) * 1e5)

    class Passthrough(nn.Module):
        def forward(self, x):
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.amp, self.drop, self.head = Amplified(), Passthrough(), nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.drop(self.amp(x)))

    torch.manual_seed(0)
    db = tmp_path / "parent.db"
    fp16_steps(Model(), db, lambda: torch.ones(4, 8), lambda out: out.mean())
    listed = {path for (path,) in rows(db, "SELECT path FROM modules")}
    assert {"amp", "amp.proj", "drop", "head"} <= listed
    with_rows = {path for (path,) in rows(db, "SELECT DISTINCT m.path FROM act_stats a JOIN modules m ON m.id = a.module_id")}
    assert with_rows == {"amp.proj", "head"}  # amp's output is amp.proj's; drop returns its input
    # amp.proj's FP32 replay on the Inf it received stays Inf: the replay escalates to amp,
    # whose FP32 run is finite, although amp's output is the tensor amp.proj returned.
    assert rows(db, "SELECT module, outcome FROM replays ORDER BY id")[:2] == [("amp.proj", "nonfinite"),
                                                                               ("amp", "finite")]
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "forward-nonfinite", "amp")


def test_a_block_that_overflows_its_childs_output_in_place_is_blamed_not_the_next_module(tmp_path, verdict):
    class Basic(nn.Module):
        """torchvision's BasicBlock pattern: the residual added in place to the child's
        output, then an in-place ReLU; the block returns its child's tensor, changed."""

        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.bn(self.conv(x))
            out += x * 1e5  # the block's own code: overflows fp16
            return self.relu(out)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.layer1, self.fc = nn.Conv2d(3, 4, 3, padding=1), Basic(), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.layer1(self.stem(x)).mean((2, 3)))

    torch.manual_seed(0)
    db = tmp_path / "inplace.db"
    fp16_steps(Net(), db, lambda: torch.randn(2, 3, 8, 8),
               lambda out: nn.functional.cross_entropy(out, torch.tensor([0, 1])))
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"], first["confirmation"]) == (1, "forward-nonfinite", "layer1",
                                                                             "confirmed")


class CausalMask(nn.Module):
    """Fills the scores above the diagonal with -inf: NaN/Inf by design, in any precision."""

    def forward(self, scores):
        n = scores.shape[-1]
        return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.qkv, self.mask, self.out = nn.Linear(8, 32), nn.Linear(32, 96), CausalMask(), nn.Linear(32, 1)

    def forward(self, x):
        q, k, v = self.qkv(self.inp(x)).chunk(3, -1)
        return self.out(self.mask(q @ k.transpose(-1, -2) / 32 ** 0.5).softmax(-1) @ v)


def test_a_mask_module_making_minus_inf_by_design_is_not_a_failure(tmp_path, verdict):
    # Its FP32 replay is -inf too, from finite scores: "intrinsic", not an fp16 overflow
    # and nothing its parent's code did. Softmax absorbs the -inf, the loss stays finite.
    db = tmp_path / "mask.db"
    torch.manual_seed(0)
    fp16_steps(MaskedAttention(), db, lambda: torch.randn(4, 16, 8),
               lambda out: nn.functional.mse_loss(out.float(), torch.zeros_like(out, dtype=torch.float32)), steps=6)
    assert rows(db, "SELECT module, outcome FROM replays") == [("mask", "intrinsic")]
    code, rep = verdict(db)
    assert code == 0 and rep["healthy"], rep["findings"]
    assert [(f["rule"], f["module"], f["severity"]) for f in rep["findings"]] == [("forward-nonfinite", "mask", "info")]


def test_an_fp16_overflow_after_a_mask_is_named_not_the_mask(tmp_path, verdict):
    # out's weights make its output overflow fp16 (finite in FP32): the mask, first in
    # forward order with its -inf, is by design; out is what the report must name.
    db = tmp_path / "mask-overflow.db"
    torch.manual_seed(0)
    model = MaskedAttention()
    with torch.no_grad():
        model.out.weight.mul_(3e4)
    fp16_steps(model, db, lambda: torch.randn(4, 16, 8) * 30, lambda out: out.float().mean(), steps=4)
    assert sorted(rows(db, "SELECT module, outcome FROM replays")) == [("mask", "intrinsic"), ("out", "finite")]
    code, rep = verdict(db)
    assert code == 1
    top = rep["findings"][0]
    assert (top["rule"], top["module"], top["severity"]) == ("forward-nonfinite", "out", "error")
    assert rep["skipped_steps"][0]["forward_module"] == "out"


class Vae(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Linear(32, 64), nn.Linear(64, 8), nn.Linear(64, 8)
        self.dec = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x):
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        return self.dec(mu + torch.exp(0.5 * logvar) * torch.randn_like(mu))  # exp(12.5) > 65504 in fp16


def test_a_vaes_reparameterisation_overflowing_in_the_models_forward_is_placed_between_logvar_and_the_decoder(
        tmp_path, verdict):
    torch.manual_seed(0)
    model = Vae()
    with torch.no_grad():
        model.logvar.bias.fill_(25.0)
    db = tmp_path / "vae.db"
    fp16_steps(model, db, lambda: torch.randn(16, 32), lambda out: out.pow(2).mean())
    code, rep = verdict(db)
    fw = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert (code, fw["severity"], fw["module"]) == (1, "error", "")
    assert fw["title"].endswith("outside its submodules, between logvar and dec.0")


def test_a_module_with_a_users_hook_is_not_replayed_so_the_hook_sees_only_the_models_calls(tmp_path, verdict):
    # A feature extractor's hook (distillation, a perceptual loss) keeps the module's output
    # for the loss code to read. A replay on a copy of the module would run that hook too:
    # it would count a call the model never made and leave the copy's FP32 output in the
    # dict, where the loss expects the model's own.
    class Loud(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) * 1e6  # overflows fp16

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Loud()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.block(x))

    torch.manual_seed(0)
    model = Outer()
    features, calls = {}, []

    def keep(module, args, output):
        calls.append(output.dtype)
        features["block"] = output

    model.block.register_forward_hook(keep)
    db = tmp_path / "features.db"
    fp16_steps(model, db, lambda: torch.ones(4, 8), lambda out: out.mean())
    assert calls == [torch.float16] * 3  # one per step, the model's own
    assert not torch.isfinite(features["block"]).all()
    [(module, outcome, reason)] = rows(db, "SELECT module, outcome, reason FROM replays")
    assert (module, outcome) == ("block", "unconfirmed")
    assert "a hook that is neither torch's nor ampdiag's" in reason
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (first["rule"], first["module"], first["confirmation"]) == ("forward-nonfinite", "block", "unconfirmed")
