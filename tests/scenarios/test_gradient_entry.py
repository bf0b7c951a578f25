"""A skipped step's first NaN/Inf gradient names a module; the gradient reaching that
module's output on its next skip says whether its own backward made them (event
"module-output-gradient", "PATH: finite") or the code after it did ("PATH: nonfinite"):
then the report blames that code, not the module alone."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import ampdiag
from conftest import rows


class GainVAE(nn.Module):
    """A VAE whose encoder output is multiplied by a gain in its own forward(): the gain's
    fp16 backward overflows, and the encoder's last layer only receives the Inf."""

    def __init__(self, gain):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 16))
        self.dec = nn.Sequential(nn.Linear(8, 128), nn.SiLU(), nn.Linear(128, 64))
        self.gain = gain

    def encode(self, x):
        return self.enc(x) * self.gain

    def forward(self, x):
        mu, logvar = self.encode(x).chunk(2, -1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


class MixVAE(GainVAE):
    """The gain in a module's weights instead: a Linear `mix` after the encoder, 30 times the
    identity. mix's fp16 backward overflows the gradient it sends to enc.2's output, while
    its own gradients stay finite."""

    def __init__(self, gain):
        super().__init__(1.0)
        self.mix = nn.Linear(16, 16)
        with torch.no_grad():
            self.mix.weight.copy_(torch.eye(16) * gain)
            self.mix.bias.zero_()

    def encode(self, x):
        return self.mix(self.enc(x))


class DropMixVAE(MixVAE):
    """MixVAE with a Dropout between the encoder and mix: a module without parameters, whose
    backward leaves no gradient to show where it ran."""

    def __init__(self, gain):
        super().__init__(gain)
        self.drop = nn.Dropout(0.1)

    def encode(self, x):
        return self.mix(self.drop(self.enc(x)))


def vae_steps(db, gain, steps=16, pin=False, kind=GainVAE, pins=()):
    torch.manual_seed(0)
    model = kind(gain)
    if pin:
        ampdiag.pin_fp32(model.enc[2])
    for path in pins:
        ampdiag.pin_fp32(model.get_submodule(path))
    opt, scaler = torch.optim.Adam(model.parameters(), 1e-3), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x = torch.rand(32, 64)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                recon, mu, logvar = model(x)
                kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / 32
                loss = F.binary_cross_entropy_with_logits(recon, x, reduction="sum") / 32 + kl
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def entries(db):
    return rows(db, "SELECT detail FROM events WHERE kind = 'module-output-gradient'")


def senders(db):
    return rows(db, "SELECT detail FROM events WHERE kind = 'module-gradient-sender'")


def test_a_gradient_made_by_the_code_after_a_module_is_blamed_on_that_code(tmp_path, verdict):
    db = tmp_path / "gain.db"
    vae_steps(db, gain=30.0)
    assert entries(db) == [("enc.2: nonfinite",)]
    assert senders(db) == []  # the gain is the model's own code: no module sent them
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "overflow-origin", "enc.2")
    assert first["title"].endswith("they reach it through its output: the code that uses enc.2's output makes them")
    assert first["suggestions"][0]["summary"].startswith("Run enc.2 in FP32 (pinned")


def test_the_pin_the_report_gives_keeps_the_scale_up(tmp_path, verdict):
    # Its first fix, enc.2 pinned: its output and the gradient it receives are float32,
    # and so is the gain after it; only the scaler's calibration skips are left.
    db = tmp_path / "pinned.db"
    vae_steps(db, gain=30.0, steps=24, pin=True)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


@pytest.mark.parametrize("kind, via", [(MixVAE, ""), (DropMixVAE, " through drop")], ids=["directly", "through_a_dropout"])
def test_the_module_whose_backward_sends_the_inf_is_named_and_pinned_with_the_one_it_reaches(tmp_path, verdict, kind,
                                                                                           via):
    # Through a Dropout: a module without parameters, which leaves no gradient of its own.
    db = tmp_path / "mix.db"
    vae_steps(db, gain=30.0, steps=24, kind=kind)
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "overflow-origin", "enc.2")
    # The look at what each module given enc.2's output sent back (event module-gradient-sender).
    assert senders(db) == [("enc.2: mix",)]
    assert f"mix, given enc.2's output{via}, received a finite gradient at its own output and sent NaN/Inf back" \
        in first["evidence"]
    assert first["title"].endswith("they reach it through its output: mix's backward makes them")
    assert first["suggestions"][0]["summary"].startswith("Run enc.2 and mix in FP32")


def test_the_module_the_inf_reaches_pinned_alone_still_collapses_the_scale(tmp_path, verdict):
    # Why the fix above pins both: enc.2 pinned, mix's backward still runs in fp16 under
    # autocast and hands enc.2 the overflowed gradient.
    db = tmp_path / "enc_pinned.db"
    vae_steps(db, gain=30.0, steps=40, kind=MixVAE, pins=("enc.2",))
    code, rep = verdict(db)
    assert code == 1
    assert any(f["rule"] == "scale-collapse" for f in rep["findings"])
    # The report knows enc.2 ran pinned: it offers mix's pin, not enc.2's again.
    fixes = [s["python"] for f in rep["findings"] for s in f["suggestions"]]
    assert not any("pin_fp32(model.enc[2])" in fix for fix in fixes)
    assert any(fix.startswith("ampdiag.pin_fp32(model.mix)") for fix in fixes)


def test_both_modules_pinned_as_the_report_gives_keep_the_scale_up(tmp_path, verdict):
    db = tmp_path / "both_pinned.db"
    vae_steps(db, gain=30.0, steps=40, kind=MixVAE, pins=("enc.2", "mix"))
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


def test_a_module_whose_own_backward_overflows_is_confirmed_by_a_finite_output_gradient(tmp_path, verdict):
    # Raw readings up to 255: the head's weight gradient (its large input times the
    # gradient it receives) overflows inside its own backward.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-6), torch.amp.GradScaler("cpu")
    db = tmp_path / "raw.db"
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(8):
            x = torch.rand(256, 16) * 255
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), x.mean(1, keepdim=True))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert entries(db) == [("2: finite",), ("2: finite",)]  # judged finite: looked at once more
    code, rep = verdict(db)
    origin = next(f for f in rep["findings"] if f["rule"] == "overflow-origin")
    assert origin["module"] == "2"
    assert "the gradient reaching its output was finite: its own backward made them" in origin["evidence"]


class FeaturesAndLogits(nn.Module):
    """A classifier returning its features first, beside its logits times a gain (metric
    learning, distillation): the features are the head's input, not where backward starts."""

    def __init__(self, gain):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128))
        self.head = nn.Linear(128, 10)
        self.gain = gain

    def forward(self, x):
        features = self.body(x)
        return features, self.head(features) * self.gain


def test_a_gain_after_the_head_is_blamed_where_the_features_are_returned_first(tmp_path, verdict):
    # The gain's fp16 backward overflows inside the model: the features returned first then
    # receive NaN/Inf from the head's backward, which the loss's backward did not make.
    torch.manual_seed(0)
    model = FeaturesAndLogits(3000.0)
    opt, scaler = torch.optim.AdamW(model.parameters(), 1e-3), torch.amp.GradScaler("cpu")
    db = tmp_path / "features.db"
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(30):
            x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                _, logits = model(x)
            scaler.scale(F.cross_entropy(logits.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "overflow-origin", "head")
    assert first["title"].endswith("they reach it through its output: the code that uses head's output makes them")
    assert "loss-backward" not in {f["rule"] for f in rep["findings"]}


class TwoHeads(nn.Module):
    """A detection-style model: a classifier and a box head on one backbone's pooled features,
    the box head's weights 5000 times too large. Its fp16 backward overflows the gradient it
    sends to the features; the classifier's backward, which runs after it, sends a finite one.
    The backbone's convolution, behind a ReLU (a module the agent lists no rows for), receives
    their sum."""

    def __init__(self, cls_gain=1.0, box_gain=5000.0):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.cls, self.box = nn.Linear(16, 5), nn.Linear(16, 4)
        with torch.no_grad():
            self.box.weight.mul_(box_gain)
            self.cls.weight.mul_(cls_gain)

    def forward(self, x):
        f = self.backbone(x)
        return self.cls(f), self.box(f)


def two_heads_steps(db, pins=(), cls_gain=1.0, wrap=None, box_gain=5000.0):
    torch.manual_seed(0)
    model = TwoHeads(cls_gain, box_gain) if wrap is None else wrap(TwoHeads(cls_gain, box_gain))
    for path in pins:
        ampdiag.pin_fp32(model.get_submodule(path))
    opt, scaler = torch.optim.SGD(model.parameters(), 1e-3, momentum=0.9), torch.amp.GradScaler("cpu")
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(30):
            x, labels, boxes = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,)), torch.rand(8, 4) * 100
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits, box = model(x)
                loss = F.cross_entropy(logits, labels) + F.smooth_l1_loss(box, boxes, reduction="sum") / 8
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_of_two_heads_on_one_output_the_one_whose_backward_sent_the_inf_is_named_and_pinned(tmp_path, verdict):
    # cls's backward ran just before the backbone's: order alone would name it.
    db = tmp_path / "heads.db"
    two_heads_steps(db)
    assert senders(db) == [("backbone.0: box",)]
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert (code, first["rule"], first["module"]) == (1, "overflow-origin", "backbone.0")
    assert first["title"].endswith("they reach it through its output: box's backward makes them")
    # box's weights start 5000 times too large: its backward multiplies the gradient by that.
    assert first["suggestions"][0]["summary"].startswith(
        "Initialise box at a standard scale (torch's default, Kaiming or Xavier): its weights start at a gain of ")
    assert "so the gradient its backward sends back to backbone.0 is about that many times" in first["suggestions"][0]["summary"]
    assert first["suggestions"][1]["summary"].startswith("Where that gain is by design, run backbone.0 and box in FP32")
    assert first["suggestions"][1]["python"] == ("ampdiag.pin_fp32(model.backbone[0])  # autocast off inside each; "
                                                 "float inputs cast\nampdiag.pin_fp32(model.box)")
    collapse = next(f for f in rep["findings"] if f["rule"] == "scale-collapse")
    assert collapse["suggestions"][0]["summary"].startswith("Fix the NaN/Inf made in box's backward")
    # box's own bias overflowed first only at the initial scale: its pin alone is no fix.
    box = next(f for f in rep["findings"] if f["rule"] == "overflow-origin" and f["module"] == "box")
    assert (box["severity"], box["suggestions"]) == ("info", [])
    # The cause: box's 64 weights, 5000 times a standard initialisation's.
    oversized = next(f for f in rep["findings"] if f["rule"] == "oversized-weights")
    assert (oversized["layer"], oversized["severity"]) == ("box.weight", "warning")


def test_the_box_head_at_a_standard_initialisation_keeps_the_scale_up(tmp_path, verdict):
    # The first fix the report gives: box's weights re-initialised.
    db = tmp_path / "heads_box_reset.db"
    two_heads_steps(db, box_gain=1.0)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


def test_the_box_head_pinned_alone_still_collapses_the_scale(tmp_path, verdict):
    db = tmp_path / "heads_box_pinned.db"
    two_heads_steps(db, pins=("box",))
    code, rep = verdict(db)
    assert code == 1
    assert any(f["rule"] == "scale-collapse" for f in rep["findings"])


def test_a_model_attached_in_its_data_parallel_wrapper_is_looked_at_where_it_is_unwrapped(tmp_path, verdict):
    # DataParallel (on the CPU it only calls the model) names every layer under "module.",
    # as DistributedDataParallel does: a module holding every layer is the model's place,
    # not a module the backward overflowed in.
    db = tmp_path / "wrapped_heads.db"
    two_heads_steps(db, wrap=nn.DataParallel)
    assert ("module.backbone.0: nonfinite",) in entries(db)
    assert senders(db) == [("module.backbone.0: module.box",)]
    code, rep = verdict(db)
    assert [f["module"] for f in rep["findings"] if f["rule"] == "overflow-origin"] == ["module.backbone.0", "module.box"]


def test_two_heads_that_both_sent_the_inf_are_named_and_pinned_with_the_backbone(tmp_path, verdict):
    db = tmp_path / "both_heads.db"
    two_heads_steps(db, cls_gain=5000.0)
    assert senders(db) == [("backbone.0: box, cls",)]
    code, rep = verdict(db)
    first = rep["findings"][0]
    assert [s["python"].split("\n")[0] for s in first["suggestions"][:2]] == [
        'model.get_submodule("box").reset_parameters()  # torch\'s default initialisation (Linear, Conv)',
        'model.get_submodule("cls").reset_parameters()  # torch\'s default initialisation (Linear, Conv)']
    assert first["suggestions"][2]["python"].endswith("ampdiag.pin_fp32(model.box)\nampdiag.pin_fp32(model.cls)")


def test_the_three_modules_that_report_pins_keep_the_scale_up(tmp_path, verdict):
    db = tmp_path / "both_heads_pinned.db"
    two_heads_steps(db, pins=("backbone.0", "box", "cls"), cls_gain=5000.0)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


def test_both_modules_the_two_heads_report_pins_keep_the_scale_up(tmp_path, verdict):
    db = tmp_path / "heads_pinned.db"
    two_heads_steps(db, pins=("backbone.0", "box"))
    code, rep = verdict(db)
    assert code == 0, rep["findings"]


def test_the_head_that_ran_just_before_pinned_with_the_backbone_still_collapses_the_scale(tmp_path, verdict):
    # What the order alone would have offered: the box head still overflows in fp16.
    db = tmp_path / "heads_cls_pinned.db"
    two_heads_steps(db, pins=("backbone.0", "cls"))
    code, rep = verdict(db)
    assert code == 1
    assert any(f["rule"] == "scale-collapse" for f in rep["findings"])


class SplitGain(nn.Module):
    """enc's output chunked in two by a module without parameters: one half to a head, the
    other times a gain in the model's own forward(), whose fp16 backward overflows. The split
    receives a finite gradient at its first output and NaN/Inf at its second, and its one
    autograd node sends their join back: it only passes them on."""

    def __init__(self):
        super().__init__()
        self.enc, self.split, self.head = nn.Linear(16, 32), Split(), nn.Linear(16, 1)

    def forward(self, x):
        a, b = self.split(self.enc(x))
        return self.head(a).squeeze(-1) + (b * 3000.0).mean(-1)


class Split(nn.Module):
    def forward(self, x):
        return x.chunk(2, -1)  # two views of one autograd node, whose backward joins their gradients


def test_a_module_that_received_the_inf_at_another_of_its_outputs_is_not_named_as_its_sender(tmp_path, verdict):
    torch.manual_seed(0)
    model = SplitGain()
    opt, scaler = torch.optim.SGD(model.parameters(), 1e-3), torch.amp.GradScaler("cpu")
    db = tmp_path / "split.db"
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(30):
            x, y = torch.randn(64, 16), torch.randn(64)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y, reduction="sum")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert ("enc: nonfinite",) in entries(db)
    assert senders(db) == []
