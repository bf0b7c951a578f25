"""Models nobody here wrote, trained on CUDA as their users do (Hugging Face GPT-2 with
AdamW, a warm-up schedule and clipping after unscale_; a timm ViT, also under timm's
NativeScaler; a torchvision ResNet in channels_last; a cuDNN LSTM), with ampdiag
attached: a healthy run's report holds no finding at all, and a planted overflow is named
at its module. Skipped without a CUDA device, and each model without its library (the GPU
machines' image has them; the project does not depend on them)."""
import json
import subprocess

import pytest
import torch
from torch import nn

import ampdiag

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")

VOCAB = 5000


def findings(ampdiag_cli, db):
    """(exit code under --fail-on error, the report's findings)."""
    result = subprocess.run([ampdiag_cli, "report", str(db), "--fail-on", "error", "--format", "json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)["findings"]


def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).cuda()


def token_batches(n, batch=16, tokens=64):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, tokens), generator=generator).cuda() for _ in range(n)]


def train_lm(model, db, steps, dtype=torch.float16, accumulate=1):
    """AdamW under get_linear_schedule_with_warmup, clipping after unscale_ (with a scaler)."""
    transformers = pytest.importorskip("transformers")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, 10, steps)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    handle = ampdiag.attach(model, scaler, db=db) if scaler else ampdiag.attach(model, optimizer=optimizer, db=db)
    batches = iter(token_batches(steps * accumulate))
    with handle:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            for _ in range(accumulate):
                ids = next(batches)
                with torch.autocast("cuda", dtype=dtype):
                    loss = model(input_ids=ids, labels=ids).loss / accumulate
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            schedule.step()


def train_images(model, db, steps=30, size=224, channels_last=False):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    generator = torch.Generator().manual_seed(2)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            x = torch.randn(32, 3, size, size, generator=generator).cuda()
            y = torch.randint(0, 10, (32,), generator=generator).cuda()
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


class LstmLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(VOCAB, 256), nn.LSTM(256, 512, 2, batch_first=True), \
            nn.Linear(512, VOCAB)

    def forward(self, ids):
        return self.out(self.rnn(self.emb(ids))[0])


def train_lstm(db, steps=40):
    torch.manual_seed(0)
    model = LstmLM().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    with ampdiag.attach(model, scaler, db=db):
        for ids in token_batches(steps):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(ids[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()


def timm_vit(db):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    train_images(timm.create_model("vit_tiny_patch16_224", num_classes=10).cuda(), db)


def timm_vit_native_scaler(db, steps=20, accumulate=2):
    """timm's train.py: its NativeScaler (which holds the GradScaler) given to attach(),
    micro-batches that update on the last one, clipping after unscale_."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    loss_scaler = timm.utils.NativeScaler()
    generator = torch.Generator().manual_seed(2)
    with ampdiag.attach(model, loss_scaler, db=db):
        for _ in range(steps):
            for micro in range(accumulate):
                x = torch.randn(16, 3, 224, 224, generator=generator).cuda()
                y = torch.randint(0, 10, (16,), generator=generator).cuda()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x), y) / accumulate
                loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters(),
                            need_update=micro == accumulate - 1)
            optimizer.zero_grad(set_to_none=True)


def resnet_channels_last(db):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda().to(memory_format=torch.channels_last)
    train_images(model, db, size=128, channels_last=True)


HEALTHY = {
    "gpt2 fp16": lambda db: train_lm(gpt2(), db, 60),
    "gpt2 fp16, 4 micro-batches a step": lambda db: train_lm(gpt2(), db, 30, accumulate=4),
    "gpt2 bf16 without a scaler": lambda db: train_lm(gpt2(), db, 40, dtype=torch.bfloat16),
    "timm vit_tiny": timm_vit,
    "timm vit_tiny, timm's NativeScaler, 2 micro-batches": timm_vit_native_scaler,
    "torchvision resnet18, channels_last": resnet_channels_last,
    "cuDNN LSTM language model": train_lstm,
}


@pytest.mark.parametrize("loop", HEALTHY, ids=list(HEALTHY))
def test_a_healthy_run_of_a_real_model_has_no_finding(tmp_path, ampdiag_cli, loop):
    HEALTHY[loop](tmp_path / "run.db")
    code, found = findings(ampdiag_cli, tmp_path / "run.db")
    assert (code, found) == (0, [])


def test_a_gpt2_projection_that_overflows_in_forward_is_named(tmp_path, ampdiag_cli):
    model = gpt2()
    with torch.no_grad():
        model.transformer.h[2].mlp.c_fc.weight.mul_(1e5)  # its output passes 65504 from the first step
    train_lm(model, tmp_path / "run.db", 30)
    code, found = findings(ampdiag_cli, tmp_path / "run.db")
    first = [f for f in found if f["rule"] == "forward-nonfinite"]
    assert code == 1 and first and first[0]["module"] == "transformer.h.2.mlp.c_fc"
