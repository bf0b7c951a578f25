"""A small pre-norm ViT-style transformer trained with fp16 autocast on the CPU whose
attention in block1.0 produces gradients too large for fp16: its backward overflows again
and again, each overflow skips a step and halves the loss scale, and the scale slides far
below 128. `--pin-fp32 block1.0.attn` keeps that attention in FP32 and the run healthy.

The planted fault: block1.0's attention computes attn @ (v / GAIN) and scales the result
back up by GAIN. Forward values and true gradients are ordinary; in backward the fp16
gradient of that product is GAIN times larger than anything else.

    python samples/python/vit_overflow.py --db vit.db && ampdiag report vit.db
"""
import torch
from torch import nn

import ampdiag
from _sample import Summary, parse_args, run

DIM, HEADS, TOKENS, BATCH, DEPTH, GAIN = 32, 4, 16, 32, 2, 3.0e5


class Attention(nn.Module):
    def __init__(self, gain: float = 1.0):
        super().__init__()
        self.qkv, self.proj, self.gain = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), gain

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-2, -1) / (DIM // HEADS) ** 0.5, dim=-1)
        y = (attn @ (v / self.gain)).transpose(1, 2).reshape(b, t, DIM)
        return self.proj(y * self.gain)


class Block(nn.Module):
    def __init__(self, gain: float):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention(gain)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Vit(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.block1 = nn.ModuleList([Block(GAIN if i == 0 else 1.0) for i in range(DEPTH)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.block1:
            x = block(x)
        return self.head(x.mean(1))


def main():
    args = parse_args(__doc__.splitlines()[0], "vit_overflow.db", 60,
                      ["block1.0.attn", "block1.1.attn", "block1.0.mlp", "head"])
    torch.manual_seed(args.seed)
    model = Vit()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10)  # short, so 60 steps show the scale trying to recover
    inputs, targets = torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, 1)
    summary = Summary()
    with ampdiag.attach(model, scaler, db=args.db, overwrite=True, pins=args.pin_fp32) as handle:
        for _ in range(args.steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(inputs).float(), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scale = scaler.get_scale()  # after update(), as the report shows it
            summary.step(loss.item(), handle.last_step_skipped, scale)
    summary.print("vit_overflow", args, handle)


if __name__ == "__main__":
    run(main)
