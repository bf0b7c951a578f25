"""Loops users write every day, healthy: each must exit 0 under --fail-on error, with the
steps and losses counted as docs/PYTHON.md says."""
import copy
import math

import pytest
import torch
from torch import nn

import ampdiag
from conftest import amp_step, rows, rules
from fp16_loop import Mlp, batches, bf16_loop, fp16_loop


def test_an_extra_update_holding_a_minimum_scale_is_the_same_step(tmp_path, verdict):
    # Half the batches overflow fp16 in backward: the scale falls, the loop holds it at 2**14.
    class Spiky(Mlp):
        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.c(torch.relu(self.b(h))) * (1.0 if x[0, 0] > 0 else 3e4)

    db = tmp_path / "hold.db"
    _, skipped = fp16_loop(db, steps=40, hold_min_scale=2.0 ** 14, model=Spiky())
    steps = rows(db, "SELECT step, skipped, scale_after, loss FROM steps ORDER BY step")
    assert len(steps) == 40  # one row per optimizer cycle, however many update() calls
    assert [bool(s) for _, s, _, _ in steps] == skipped
    assert any(skipped)
    assert min(after for _, _, after, _ in steps) == 2.0 ** 14  # the held scale, not the backed-off one
    assert all(math.isfinite(loss) for *_, loss in steps)
    code, rep = verdict(db)
    assert ("forward-nonfinite", "") not in rules(rep)  # no false "loss NaN/Inf"


def test_gradient_accumulation_records_the_cycle_loss_and_micro_batches(tmp_path, verdict):
    db = tmp_path / "accum.db"
    seen, _ = fp16_loop(db, steps=6, micro=4)
    assert [loss for (loss,) in rows(db, "SELECT loss FROM steps ORDER BY step")] == pytest.approx(seen, rel=1e-5)
    assert rows(db, "SELECT DISTINCT losses FROM steps") == [(4,)]
    per_step = rows(db, "SELECT step, GROUP_CONCAT(DISTINCT micro_batch) FROM act_stats GROUP BY step")
    assert {mb for _, mb in per_step} == {"0,1,2,3"}
    assert verdict(db)[0] == 0


def test_two_losses_and_one_scaler_record_their_sum(tmp_path, verdict):
    db = tmp_path / "two.db"
    seen, _ = fp16_loop(db, steps=5, two_losses=True)
    assert [loss for (loss,) in rows(db, "SELECT loss FROM steps ORDER BY step")] == pytest.approx(seen, rel=1e-5)
    assert rows(db, "SELECT DISTINCT losses FROM steps") == [(2,)]
    assert rows(db, "SELECT COUNT(DISTINCT micro_batch) FROM act_stats") == [(1,)]  # one forward per step
    assert verdict(db)[0] == 0


def test_unscale_and_clipping_is_healthy(tmp_path, verdict):
    db = tmp_path / "clip.db"
    fp16_loop(db, steps=10, clip=True)
    assert rows(db, "SELECT COUNT(*) FROM steps") == [(10,)]
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True)


def test_zero_grad_without_set_to_none_and_an_unused_branch_is_healthy(tmp_path, verdict):
    class Branchy(Mlp):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(32, 32)  # never called: its gradient stays all zeros

    db = tmp_path / "zeros.db"
    fp16_loop(db, steps=8, set_to_none=False, model=Branchy())
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]


def test_frozen_layers_batchnorm_and_channels_last_are_healthy(tmp_path, verdict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)).to(memory_format=torch.channels_last)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "conv.db"
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(6):
            x = torch.randn(8, 3, 16, 16).to(memory_format=torch.channels_last)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.randint(0, 2, (8,)))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]


def test_an_embedding_whose_rows_a_batch_never_touches_is_not_underflow(tmp_path, verdict):
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = nn.Embedding(1000, 32), nn.Embedding(64, 32)
            self.head = nn.Linear(32, 1)

        def forward(self, ids):
            return self.head((self.embed(ids) + self.pos.weight[: ids.shape[1]]).mean(1))

    torch.manual_seed(0)
    model = Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "embed.db"
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(8):
            ids = torch.randint(0, 50, (4, 8))  # 50 of 1000 tokens, 8 of 64 positions
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(ids).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]


def test_two_optimizers_on_one_scaler_are_one_step(tmp_path, verdict):
    torch.manual_seed(0)
    model = Mlp()
    body = torch.optim.SGD(list(model.a.parameters()) + list(model.b.parameters()), lr=0.01)
    head = torch.optim.Adam(model.c.parameters(), lr=1e-3)
    # At torch's default 65536 this model's head overflows once in 6 steps, a real skip
    # (the run without ampdiag skips the same step): start where it does not.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    db = tmp_path / "two_opt.db"
    with ampdiag.attach(model, scaler, db=db):
        for x, y in batches(6):
            body.zero_grad()
            head.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(body)
            scaler.step(head)
            scaler.update()
    assert rows(db, "SELECT COUNT(*) FROM steps") == [(6,)]
    # both optimizers' parameters have statistics in every step
    assert rows(db, "SELECT DISTINCT COUNT(*) FROM grad_stats GROUP BY step") == [(6,)]
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]


def gan_loop(db, attach_both):
    """A GAN's loop from torch's AMP examples: one scaler, the discriminator's step, then the
    generator's, one update(). Attached to the generator alone, or to both in a ModuleDict."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    disc = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=2e-4, betas=(0.5, 0.999)) for m in (gen, disc))
    scaler = torch.amp.GradScaler("cpu")
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    with ampdiag.attach(nn.ModuleDict({"G": gen, "D": disc}) if attach_both else gen, scaler, db=db):
        for _ in range(6):
            real, z = torch.randn(16, 16) + 2, torch.randn(16, 8)
            opt_d.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gen(z)
                loss_d = bce(disc(real), ones) + bce(disc(fake.detach()), zeros)
            scaler.scale(loss_d).backward()
            scaler.step(opt_d)
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss_g = bce(disc(fake), ones)
            scaler.scale(loss_g).backward()
            scaler.step(opt_g)
            scaler.update()


def test_a_gan_with_only_its_generator_attached_names_the_discriminators_parameters_as_outside_the_model(
        tmp_path, verdict):
    # Its first step overflows at the discriminator's last layer (a calibration skip).
    db = tmp_path / "gan_g.db"
    gan_loop(db, attach_both=False)
    assert rows(db, "SELECT COUNT(*), MIN(losses) FROM steps") == [(6, 2)]  # one step per update(), both losses
    code, rep = verdict(db)
    assert code == 0
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["title"].startswith("optimizer.param6, a parameter outside the attached model,")


def test_a_gan_attached_as_one_module_dict_names_the_discriminators_layer(tmp_path, verdict):
    db = tmp_path / "gan_both.db"
    gan_loop(db, attach_both=True)
    code, rep = verdict(db)
    assert code == 0
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert (origin["module"], origin["layer"]) == ("D.2", "D.2.weight")


class LinearProbe(nn.Module):
    """A frozen backbone run under no_grad inside the model's forward, a trained head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        self.head = nn.Linear(64, 1)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            features = self.backbone(x)
        return self.head(features)


def test_a_frozen_backbone_under_no_grad_inside_the_forward_is_watched_and_named_when_it_overflows(tmp_path, verdict):
    # Its last layer's fp16 output passes 65504 on the batches scaled by 4: named, not
    # "the model's own forward()" (the head only received the Inf).
    torch.manual_seed(0)
    model = LinearProbe()
    with torch.no_grad():
        model.backbone[2].weight.mul_(3e4)
    opt = torch.optim.SGD(model.head.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "linear_probe.db"
    with ampdiag.attach(model, scaler, db=db):
        for step in range(4):
            x = torch.randn(16, 16) * (4.0 if step == 2 else 1.0)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), torch.randn(16, 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    _, rep = verdict(db)
    forward = next(f for f in rep["findings"] if f["rule"] == "forward-nonfinite")
    assert (forward["module"], forward["confirmation"]) == ("backbone.2", "confirmed")


def settling_run(db, init_scale=2.0 ** 16, growth_interval=8):
    """The bias gradient is 32 * 0.4 * scale: finite at 4096, Inf at 8192. The scaler comes
    down from `init_scale`, settles at 4096 and every `growth_interval` steps probes 8192 and
    backs off. Returns the final scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(64):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(32, 16) * 0.05).float().sum() * 0.4
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return scaler.get_scale()


def test_a_scale_that_settles_at_4096_and_probes_for_growth_is_not_a_collapse(tmp_path, verdict):
    # Every 8 steps a probe of 8192 and a back-off: the scaler's job.
    db = tmp_path / "settle.db"
    assert settling_run(db) == 4096.0
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    found = {f["rule"]: f["severity"] for f in rep["findings"]}
    assert "scale-collapse" not in found and "skip-rate" not in found
    assert found.get("overflow-origin") == "info"  # named, and said to be harmless
    assert set(found.values()) == {"info"}  # nothing underflows at 4096: no warning to fail --fail-on all


def test_a_growth_interval_of_one_whose_probes_skip_half_the_steps_is_named_and_the_suggested_scaler_is_healthy(
        tmp_path, verdict):
    # Each probe is excused as the scaler's job; every second step of them is not.
    assert settling_run(tmp_path / "probing.db", growth_interval=1) in (4096.0, 8192.0)
    code, rep = verdict(tmp_path / "probing.db")
    probing = [f for f in rep["findings"] if f["rule"] == "skip-rate"]
    assert len(probing) == 1 and "growth probes" in probing[0]["title"], rep["findings"]
    assert probing[0]["severity"] in ("warning", "error")
    assert "growth_interval=1" in probing[0]["evidence"]
    suggested = probing[0]["suggestions"][0]["python"]
    assert suggested == 'scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2000)'

    assert settling_run(tmp_path / "suggested.db", init_scale=2.0 ** 12, growth_interval=2000) == 4096.0
    code, rep = verdict(tmp_path / "suggested.db")
    assert code == 0 and not [f for f in rep["findings"] if f["severity"] != "info"], rep["findings"]


def test_a_teacher_deep_copied_after_attach_is_not_recorded_as_the_student(tmp_path, verdict):
    # EMA and mean-teacher loops deep-copy the attached model; the copy carries its forward
    # hooks. Its forward (here in fp16, overflowing in its first layer) is not the
    # student's: the student trains healthily, so nothing may be blamed on "0".
    db = tmp_path / "teacher.db"
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    with ampdiag.attach(student, scaler, db=db):
        teacher = copy.deepcopy(student)
        with torch.no_grad():
            teacher[0].weight.mul_(1e4)
        for x, y in batches(30):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                with torch.no_grad():
                    assert not torch.isfinite(teacher(x * 10)).all()
                loss = nn.functional.mse_loss(student(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    assert "forward-nonfinite" not in [rule for rule, _ in rules(rep)]
    assert rows(db, "SELECT count(*) FROM act_stats WHERE nan > 0 OR inf > 0") == [(0,)]


def distillation_loop(db, teacher_gain):
    """Knowledge distillation with the frozen teacher and the student attached in one
    ModuleDict: the loop runs the teacher itself under no_grad, before the student, and the
    loss takes both outputs. `teacher_gain` multiplies the teacher's last layer."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10)).eval()
    student = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 10))
    teacher.requires_grad_(False)
    with torch.no_grad():
        teacher[2].weight.mul_(teacher_gain)
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    with ampdiag.attach(nn.ModuleDict({"teacher": teacher, "student": student}), scaler, db=db):
        for x, _ in batches(12):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                with torch.no_grad():
                    target = torch.softmax(teacher(x * 100).float() / 4, -1)
                loss = nn.functional.kl_div(torch.log_softmax(student(x).float() / 4, -1), target,
                                            reduction="batchmean")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_a_frozen_teacher_attached_with_the_student_and_run_under_no_grad_is_named_when_it_overflows(tmp_path,
                                                                                                    verdict):
    # The teacher's last layer makes values beyond 65504: its fp16 output is Inf, the soft
    # targets NaN. The teacher's forward is part of the training step, though no gradient
    # flows through it: its module is the culprit, not "the loss code after the modules".
    db = tmp_path / "distill.db"
    distillation_loop(db, teacher_gain=1e4)
    code, rep = verdict(db)
    assert code == 1
    assert rules(rep, "error")[0] == ("forward-nonfinite", "teacher.2")


def test_a_healthy_distillation_with_the_teacher_attached_records_its_outputs_and_stays_healthy(tmp_path, verdict):
    db = tmp_path / "distill_healthy.db"
    distillation_loop(db, teacher_gain=1.0)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    recorded = {path for (path,) in rows(db, "SELECT DISTINCT m.path FROM act_stats a JOIN modules m "
                                             "ON m.id = a.module_id")}
    assert {"teacher.2", "student.2"} <= recorded


class Checkpointed(nn.Module):
    """A stem, two residual blocks run through torch.utils.checkpoint, a head."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.stem, self.head = nn.Linear(16, 32), nn.Linear(32, 1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(2))

    def forward(self, x, checkpointed=True):
        x = self.stem(x)
        for block in self.blocks:
            x = x + (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant) if checkpointed
                     else block(x))
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_without_a_second_forward(tmp_path, verdict, reentrant):
    # Backward runs each checkpointed block's forward again (its hooks fire inside the
    # backward): the same values, not the next micro-batch. The rows are those of the
    # same loop without checkpointing.
    def run(db, checkpointed):
        torch.manual_seed(0)
        model = Checkpointed(reentrant)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
        with ampdiag.attach(model, scaler, db=db):
            for x, y in batches(12):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x, checkpointed).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        return rows(db, "SELECT step, fwd_order, module_id, micro_batch, absmax FROM act_stats ORDER BY step, fwd_order")

    checkpointed = run(tmp_path / "checkpointed.db", True)
    assert checkpointed == run(tmp_path / "plain.db", False)
    assert {micro_batch for *_, micro_batch, _ in checkpointed} == {0}
    code, rep = verdict(tmp_path / "checkpointed.db")
    assert code == 0, rep["findings"]


def smoke_run(db, cs):
    """A linear model from torch's default init_scale, one step per c in `cs`: its bias
    gradient is 32 * c * scale, Inf above 65504. Returns (skipped flags, the scaler)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    skipped = []
    with ampdiag.attach(model, scaler, db=db) as handle:
        for c in cs:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(32, 16) * 0.01).float().sum() * c
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(handle.last_step_skipped)
    return skipped, scaler


def test_a_short_run_whose_scale_comes_down_between_steps_that_fit_is_healthy(tmp_path, verdict):
    # A CI smoke run: 20 steps from torch's default init_scale, batches of two sizes. The
    # bias gradient is 32 * c * scale (c: 0.4 for a large batch, 0.05 for a small one), Inf
    # above 65504: the scaler skips twice, takes the small batch at 16384, halves twice
    # more on large ones and settles at 4096. Calibration, with a step that fit inside it.
    db = tmp_path / "smoke.db"
    skipped, scaler = smoke_run(db, [0.4, 0.4, 0.05, 0.4, 0.4] + [0.05, 0.4] * 7 + [0.05])
    assert skipped[:5] == [True, True, False, True, True] and not any(skipped[5:])
    assert scaler.get_scale() == 4096.0
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    assert "skip-rate" not in [rule for rule, _ in rules(rep)]


def test_a_five_step_smoke_run_that_backs_off_once_after_a_step_that_fit_is_healthy(tmp_path, verdict):
    # The first batch fits at 65536, the second does not (its bias gradient, 32 * c * scale,
    # is Inf above 65504); the run ends at 32768 before the scale has held 5 steps in a row.
    # Its one skip used to be 20 % of the run: skip-rate, and an overflow-origin error
    # that told the user to run the layer in FP32.
    db = tmp_path / "smoke.db"
    skipped, _ = smoke_run(db, [0.02, 0.04, 0.02, 0.02, 0.02])
    assert skipped == [False, True, False, False, False]
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
    assert ("overflow-origin", "info") in [(f["rule"], f["severity"]) for f in rep["findings"]]


def test_bf16_with_reentrant_checkpointing_records_the_loss_not_the_blocks_inner_backward(tmp_path):
    # A reentrant checkpoint calls torch.autograd.backward() again inside the backward, on
    # the block's recomputed outputs: that is not a root the user backpropagated.
    torch.manual_seed(0)
    bf16_loop(tmp_path / "bf16.db", Checkpointed(reentrant=True), 4)


def test_pytorchs_gradient_penalty_recipe_is_healthy_and_records_the_penalised_loss(tmp_path, verdict):
    # torch.amp's documented recipe: the scaled loss's gradients through autograd.grad with
    # create_graph=True, unscaled by hand, penalised. At 65536 they overflow fp16 and the
    # penalty is Inf: the scaler's calibration, not a NaN the loss code makes.
    db = tmp_path / "penalty.db"
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    seen = []
    with ampdiag.attach(model, scaler, db=db):
        for x, y in batches(20):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y * 100)
            scaled = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            with torch.autocast("cpu", dtype=torch.float16):
                norm = torch.stack([(g / scaler.get_scale()).pow(2).sum() for g in scaled]).sum().sqrt()
                total = loss + norm
            scaler.scale(total).backward()
            scaler.step(opt)
            scaler.update()
            seen.append(total.item())
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rules(rep)
    assert not all(map(math.isfinite, seen))  # some penalties were Inf: the calibration
    recorded = rows(db, "SELECT loss, losses FROM steps ORDER BY step")
    assert [n for _, n in recorded] == [1] * 20
    finite = [i for i, v in enumerate(seen) if math.isfinite(v)]
    assert [recorded[i][0] for i in finite] == pytest.approx([seen[i] for i in finite])


class SelfAttention(nn.Module):
    """Attention as BERT writes it: separate query, key and value projections with biases."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(d, d) for _ in range(4))
        self.norm = nn.LayerNorm(d)
        for p in (self.query, self.key, self.value, self.out):  # BERT's initializer_range
            nn.init.normal_(p.weight, std=0.02)
            nn.init.zeros_(p.bias)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.norm(x + self.out(h))


def test_an_attention_key_bias_whose_gradient_softmax_cancels_is_not_an_underflow(tmp_path, verdict):
    # The key bias adds the same q·b to every score of a query, which softmax ignores: its
    # gradient is rounding, fp16-subnormal at any scale the key weight's gradient fits.
    db = tmp_path / "attention.db"
    torch.manual_seed(0)
    model = nn.Sequential(SelfAttention(), SelfAttention(), nn.Linear(64, 1))
    opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(12):
            x = torch.randn(8, 16, 64)
            amp_step(opt, scaler, lambda: nn.functional.mse_loss(model(x).float().mean(1), x.mean(1)[:, :1]))
    # The case holds: a third or more of the key biases' gradient values fp16-subnormal
    # (about half with torch 2.15's fp16 kernels, 42 % with torch 2.5's, which then stays
    # under the underflow rule's threshold for any finding).
    [(subnormal, numel)] = rows(db, "SELECT SUM(g.fp16_subnormal), SUM(g.numel) FROM grad_stats g "
                                    "JOIN layers l ON l.id = g.layer_id WHERE l.name LIKE '%key.bias'")
    assert subnormal >= numel / 3
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), [f["title"] for f in rep["findings"]]
    cancelled = {f["layer"]: f["severity"] for f in rep["findings"] if f["rule"] == "underflow"}
    assert set(cancelled) <= {"0.key.bias", "1.key.bias"}  # subnormal: once a warning
    assert set(cancelled.values()) <= {"info"}


def test_fgsm_adversarial_training_that_clears_the_inputs_backward_before_its_step_is_healthy(tmp_path, verdict):
    # A first backward for the batch's own gradient, zero_grad(), then the step's backward
    # on the batch moved along its sign: the first backward's parameter gradients are thrown
    # away by design, not by a zero_grad() misplaced in gradient accumulation.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    db = tmp_path / "run.db"
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(12):
            x, y = torch.randn(64, 64).requires_grad_(), torch.randint(0, 10, (64,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            x_adv = (x + 0.03 * x.grad.sign()).detach()
            amp_step(opt, scaler, lambda: nn.functional.cross_entropy(model(x_adv), y))
    code, rep = verdict(db)
    assert (code, rep["healthy"]) == (0, True), rep["findings"]
