"""Step time of an ordinary PyTorch fp16-autocast training loop on the CPU (a 6-layer
nn.TransformerEncoder, d=256) without ampdiag and with ampdiag.attach() (fused unscale,
and observe-only), interleaved step by step; medians and the overhead against the loop
without it, measured in the same run. Prints a Markdown table.

    PYTHONPATH=build/python python bench/python_attach_bench.py [--steps N]
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ampdiag


def make(seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(256, 8, dim_feedforward=1024, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 6, enable_nested_tensor=False), nn.Linear(256, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.amp.GradScaler("cpu")


def step(model, optimizer, scaler, x, y, handle=None):
    t0 = time.perf_counter()
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).mean(1).float(), y)
    scaler.scale(loss).backward()
    u0 = time.perf_counter()
    scaler.unscale_(optimizer)
    u = time.perf_counter() - u0
    scaler.step(optimizer)
    scaler.update()
    return time.perf_counter() - t0, u


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    x, y = torch.randn(8, 32, 256), torch.randn(8, 1)
    with tempfile.TemporaryDirectory() as tmp:
        loops = {}
        for name, attach in (("without ampdiag", None), ("attach, fused unscale", True),
                             ("attach, observe only", False), ("attach, no activations", "noact")):
            model, optimizer, scaler = make()
            handle = None
            if attach is not None:
                handle = ampdiag.attach(model, scaler, db=Path(tmp) / f"{len(loops)}.db", fused_unscale=attach is not False,
                                        activations=attach != "noact")
            loops[name] = (model, optimizer, scaler, handle, [], [])
        for model, optimizer, scaler, handle, _, _ in loops.values():
            for _ in range(2):
                step(model, optimizer, scaler, x, y)  # warm-up
        for _ in range(args.steps):
            for model, optimizer, scaler, handle, times, unscales in loops.values():
                t, u = step(model, optimizer, scaler, x, y)
                times.append(t)
                unscales.append(u)
        params = sum(p.numel() for p in loops["without ampdiag"][0].parameters())
        base = statistics.median(loops["without ampdiag"][4])
        base_u = statistics.median(loops["without ampdiag"][5])
        print(f"## Python agent overhead: 6-layer TransformerEncoder, d=256, {params / 1e6:.1f} M parameters, "
              f"batch 8 x 32 tokens, fp16 autocast on CPU\n")
        print(f"Median of {args.steps} steps each, interleaved; torch {torch.__version__}.\n")
        print("| loop | median step ms | overhead | median unscale_() ms | cost in unscale_(), share of the step |")
        print("|---|---:|---:|---:|---:|")
        for name, (_, _, _, handle, times, unscales) in loops.items():
            t, u = statistics.median(times), statistics.median(unscales)
            print(f"| {name} | {t * 1e3:.1f} | {(t / base - 1) * 100:+.1f} % | {u * 1e3:.2f} | "
                  f"{(u - base_u) / base * 100:+.1f} % |")
            if handle:
                handle.close()


if __name__ == "__main__":
    main()
