"""Step time of ordinary PyTorch fp16-autocast training loops on the CPU without ampdiag and
with ampdiag.attach() (activations on, the default; observe-only unscale; no activations),
interleaved step by step; medians and the overhead against the loop without it, measured
in the same run. Two models: a 6-layer nn.TransformerEncoder (d=256) and a small MLP of
about 2 ms a step, where the agent's fixed cost per hook and per step shows most. Prints
Markdown tables.

    PYTHONPATH=build/python python bench/python_attach_bench.py [--steps N] [--rounds R]

Each round builds fresh loops and interleaves them for N steps; the table gives the median
over all rounds' steps, and the spread of the per-round overheads.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ampdiag


def transformer():
    layer = nn.TransformerEncoderLayer(256, 8, dim_feedforward=1024, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 6, enable_nested_tensor=False), nn.Linear(256, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.randn(8, 32, 256), torch.randn(8, 1)


def mlp():
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.randn(128, 256), torch.randn(128, 1)


MODELS = {
    "6-layer TransformerEncoder, d=256, batch 8 x 32 tokens": transformer,
    "MLP 256-512-512-512-1, batch 128": mlp,
}

LOOPS = (("without ampdiag", None), ("attach (activations on)", {}),
         ("attach, observe only", {"fused_unscale": False}), ("attach, no activations", {"activations": False}))


def step(model, optimizer, scaler, x, y):
    t0 = time.perf_counter()
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
        loss = nn.functional.mse_loss((out.mean(1) if out.dim() == 3 else out).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return time.perf_counter() - t0


def run_round(make, steps, tmp, round_index):
    loops = {}
    for name, options in LOOPS:
        torch.manual_seed(0)
        model, optimizer, x, y = make()
        scaler = torch.amp.GradScaler("cpu")
        handle = None
        if options is not None:
            handle = ampdiag.attach(model, scaler, db=Path(tmp) / f"{make.__name__}-r{round_index}-{len(loops)}.db", **options)
        loops[name] = (model, optimizer, scaler, x, y, handle, [])
    for model, optimizer, scaler, x, y, _, _ in loops.values():
        for _ in range(3):
            step(model, optimizer, scaler, x, y)  # warm-up
    for _ in range(steps):
        for model, optimizer, scaler, x, y, _, times in loops.values():
            times.append(step(model, optimizer, scaler, x, y))
    for *_, handle, _ in loops.values():
        if handle:
            handle.close()
    return {name: loop[-1] for name, loop in loops.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds of {args.steps} "
          "interleaved steps per loop.\n")
    with tempfile.TemporaryDirectory() as tmp:
        for title, make in MODELS.items():
            rounds = [run_round(make, args.steps, tmp, r) for r in range(args.rounds)]
            all_times = {name: [t for r in rounds for t in r[name]] for name, _ in LOOPS}
            base = statistics.median(all_times["without ampdiag"])
            print(f"### {title}\n")
            print("| loop | median step ms | overhead | per-round overheads |")
            print("|---|---:|---:|---|")
            for name, _ in LOOPS:
                t = statistics.median(all_times[name])
                per_round = ", ".join(f"{(statistics.median(r[name]) / statistics.median(r['without ampdiag']) - 1) * 100:+.1f}"
                                      for r in rounds)
                print(f"| {name} | {t * 1e3:.2f} | {(t / base - 1) * 100:+.1f} % | {per_round} |")
            print()


if __name__ == "__main__":
    main()
