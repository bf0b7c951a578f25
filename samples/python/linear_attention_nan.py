"""Linear attention trained with fp16 autocast on the CPU: its normaliser, a sum of the
positive key features over 4096 tokens, exceeds fp16's 65504 in forward; Inf/Inf turns
into NaN and the loss is NaN from the first step. `--pin-fp32 encoder.0.linear_attn`
fixes it, and ampdiag's replay confirms it before you try.

    python samples/python/linear_attention_nan.py --db la.db && ampdiag report la.db
"""
import torch
from torch import nn

import ampdiag
from _sample import Summary, parse_args, run

DIM, TOKENS, BATCH = 16, 4096, 2


class LinearAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        fq, fk = nn.functional.elu(self.q(x)) + 1, nn.functional.elu(self.k(x)) + 1
        kv = fk.transpose(1, 2) @ self.v(x)                      # a sum over tokens
        normaliser = fk.sum(dim=1, keepdim=True)                 # the sum that overflows fp16
        return self.out((fq @ kv) / (fq * normaliser).sum(-1, keepdim=True))


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear_attn = nn.LayerNorm(DIM), LinearAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.linear_attn(self.norm(x))
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.encoder, self.head = nn.Linear(DIM, DIM), nn.ModuleList([EncoderLayer()]), nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.embed(x) * 3.0
        for layer in self.encoder:
            x = layer(x)
        return self.head(x.mean(1))


def main():
    args = parse_args(__doc__.splitlines()[0], "linear_attention_nan.db", 40,
                      ["encoder.0.linear_attn", "encoder.0.mlp", "head"])
    torch.manual_seed(args.seed)
    model = Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    inputs, targets = torch.randn(BATCH, TOKENS, DIM) + 2.0, torch.randn(BATCH, 1)
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
    summary.print("linear_attention_nan", args, handle)


if __name__ == "__main__":
    run(main)
