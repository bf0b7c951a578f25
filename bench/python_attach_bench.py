"""Step time of ordinary PyTorch fp16-autocast training loops without ampdiag and
with ampdiag.attach() (activations on, the default; observe-only unscale; no activations),
interleaved step by step; medians and the overhead against the loop without it, measured
in the same run. Three models: a 6-layer nn.TransformerEncoder (d=256), a small MLP
(256-512-512-512-1, batch 128: 5 to 10 ms a step on the CPUs measured so far), and an MLP
of the same shape sized to about 2 ms a step on the machine it runs on (--mlp-ms), the
budget's model, where the agent's fixed cost per hook and per step shows most. Prints
Markdown tables. With --device cuda the loops run on the GPU, with a BERT-base-sized
encoder instead of the small one, and each step is timed up to a device synchronisation
(the benchmark's own, after scaler.update()).

    PYTHONPATH=build/python python bench/python_attach_bench.py [--steps N] [--rounds R] [--device cpu|cuda]
        [--precision fp16|fp32] [--mlp-ms MS] [--block K]

Each round builds fresh loops and runs them in turns of --block consecutive steps each, in
an order that rotates every turn, until every loop has N timed steps; the first step of a
turn is not timed (it inherits the previous loop's caches). A training loop runs one model
step after step: interleaved step by step (--block 1, the older measurement), a small
model's steps ran twice as long here as run consecutively while the agent's cost stayed
the same, which halved its overhead in the table. The table gives the median over all
rounds' timed steps, and the spread of the per-round overheads.
"""
import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ampdiag


def encoder(d, layers, batch, tokens):
    def make(device):
        layer = nn.TransformerEncoderLayer(d, d // 32 if d > 256 else 8, dim_feedforward=4 * d, dropout=0.0,
                                           batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(d, 1)).to(device)
        return (model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.randn(batch, tokens, d, device=device),
                torch.randn(batch, 1, device=device))
    make.__name__ = f"encoder{d}"
    return make


def mlp_of(width):
    def make(device):
        model = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)).to(device)
        return (model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.randn(128, 256, device=device),
                torch.randn(128, 1, device=device))
    make.__name__ = f"mlp{width}"
    return make


mlp = mlp_of(512)
MLP_WIDTHS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def sized_mlp(device, autocast, target_ms):
    """(width, its median step in ms): the MLP width whose step without ampdiag comes
    closest to `target_ms` here (the step time of a width is measured, not assumed: it
    depends on the CPU or GPU, the threads and the precision)."""
    best = None
    for width in MLP_WIDTHS:
        torch.manual_seed(0)
        model, optimizer, x, y = mlp_of(width)(device)
        scaler = torch.amp.GradScaler(device)
        times = [step(model, optimizer, scaler, x, y, autocast) for _ in range(30)][10:]  # warm, as the rounds time it
        ms = statistics.median(times) * 1e3
        if best is None or abs(math.log(ms / target_ms)) < abs(math.log(best[1] / target_ms)):
            best = (width, ms)
        if ms > target_ms:  # wider only takes longer
            break
    return best


MODELS = {
    "cpu": {
        "6-layer TransformerEncoder, d=256, batch 8 x 32 tokens": encoder(256, 6, 8, 32),
        "MLP 256-512-512-512-1, batch 128": mlp,
    },
    "cuda": {
        "12-layer TransformerEncoder, d=768 (BERT-base size), batch 16 x 256 tokens": encoder(768, 12, 16, 256),
        "MLP 256-512-512-512-1, batch 128": mlp,
    },
}

LOOPS = (("without ampdiag", None), ("attach (activations on)", {}),
         ("attach, observe only", {"fused_unscale": False}), ("attach, no activations", {"activations": False}))


def step(model, optimizer, scaler, x, y, autocast=True):
    t0 = time.perf_counter()
    optimizer.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16, enabled=autocast):
        out = model(x)
        loss = nn.functional.mse_loss((out.mean(1) if out.dim() == 3 else out).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_round(make, device, steps, tmp, round_index, autocast=True, block=10):
    loops = {}
    for name, options in LOOPS:
        torch.manual_seed(0)
        model, optimizer, x, y = make(device)
        scaler = torch.amp.GradScaler(device)
        handle = None
        if options is not None:
            handle = ampdiag.attach(model, scaler, db=Path(tmp) / f"{make.__name__}-r{round_index}-{len(loops)}.db", **options)
        loops[name] = (model, optimizer, scaler, x, y, handle, [])
    for model, optimizer, scaler, x, y, _, _ in loops.values():
        for _ in range(3):
            step(model, optimizer, scaler, x, y, autocast)  # warm-up
    # The order rotates every turn: the loop that runs right after another one inherits its
    # caches, which moved a loop's median by ~0.5 % in a fixed order (two identical loops
    # without ampdiag measured -0.5 % apart).
    order = list(loops.values())
    timed_per_turn = max(block - 1, 1)
    for turn in range(math.ceil(steps / timed_per_turn)):
        k = turn % len(order)
        for model, optimizer, scaler, x, y, _, times in order[k:] + order[:k]:
            for i in range(block):
                t = step(model, optimizer, scaler, x, y, autocast)
                if (i > 0 or block == 1) and len(times) < steps:
                    times.append(t)
    for *_, handle, _ in loops.values():
        if handle:
            handle.close()
    return {name: loop[-1] for name, loop in loops.items()}


def matmul_gflops(dtype, n=256, repeats=5):
    """This CPU's matrix-multiply rate in a dtype: the budgets assume fp16 about as fast as
    fp32 (AMX, AVX-512 FP16); where it is emulated, every step is many times longer and
    the overheads say nothing about them."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=sorted(MODELS), default="cpu")
    parser.add_argument("--precision", choices=("fp16", "fp32"), default="fp16",
                        help="fp32: autocast off, the same loops in float32 with the same GradScaler; a proxy on a "
                             "CPU that emulates fp16 (similar step times, every hook and check still runs, on "
                             "outputs twice the bytes), not the budgets' measurement")
    parser.add_argument("--mlp-ms", type=float, default=2.0,
                        help="the step time, in ms, the sized MLP aims at without ampdiag (the budget's 2 ms); 0: "
                             "no sized MLP")
    parser.add_argument("--block", type=int, default=10,
                        help="consecutive steps of one loop per turn, the first not timed (default 10); 1: "
                             "interleaved step by step, every step timed")
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.block < 1:
        parser.error("--steps, --rounds and --block must be at least 1")
    if not (args.mlp_ms >= 0 and math.isfinite(args.mlp_ms)):
        parser.error("--mlp-ms must be a step time in ms (0: no sized MLP)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    turns = "interleaved step by step" if args.block == 1 else f"in turns of {args.block} consecutive steps"
    print(f"torch {torch.__version__}, {where}; {args.rounds} rounds of {args.steps} timed steps per loop, {turns}.")
    if args.device == "cpu":
        fp16, fp32 = matmul_gflops(torch.float16), matmul_gflops(torch.float32)
        print(f"Matrix multiply: fp16 {fp16:.1f} GFLOP/s, fp32 {fp32:.1f} GFLOP/s.")
        if fp16 < fp32 / 4 and args.precision == "fp16":
            print("fp16 is emulated on this CPU: its steps are many times longer than the budgets assume, so these "
                  "overheads do not measure against them (docs/PERFORMANCE.md); --precision fp32 is a proxy.")
    if args.precision == "fp32":
        print("Precision fp32 (autocast off): a proxy for the fp16 loops, not the budgets' measurement.")
    models = dict(MODELS[args.device])
    if args.mlp_ms > 0:
        width, ms = sized_mlp(args.device, args.precision == "fp16", args.mlp_ms)
        models[f"MLP sized to ~{args.mlp_ms:g} ms a step here: 256-{width}-{width}-{width}-1, batch 128 "
               f"({ms:.2f} ms when sized)"] = mlp_of(width)
    print()
    with tempfile.TemporaryDirectory() as tmp:
        for title, make in models.items():
            rounds = [run_round(make, args.device, args.steps, tmp, r, args.precision == "fp16", args.block)
                      for r in range(args.rounds)]
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
