"""The Python agent's fixed cost per step: a tiny fp32 MLP (8-8-8-1, batch 4, about 1 ms a
step, nearly all of it torch's own Python and dispatch) trained with a real GradScaler and
AdamW on one CPU thread, without ampdiag and with attach(), the two loops interleaved
step by step (the order alternating) for many steps. What attach() adds to such a step
does not shrink with the model: it is the per-step and per-hook cost that the activation
budgets (docs/PERFORMANCE.md) weigh against a short step, measured with less noise than a
real model's step gives. Prints one line per attach() setting: the median step time of
both loops and the difference, and the Python calls attach() adds to a step.

    PYTHONPATH=build/python python bench/python_step_cost.py [--steps N] [--repeat R]

A machine's speed drifts by tens of per cent within minutes; compare the ratio (the cost
over the step without ampdiag) between builds run alternately, not the microseconds. The
calls a step (functions written in Python and built-in ones, as sys.setprofile sees
them) do not drift: they show a change of a few µs that the timings cannot.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ampdiag

SETTINGS = (("no activations", {"activations": False}), ("defaults (activations on)", {}))


def loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu"), torch.randn(4, 8), \
        torch.randn(4, 1)


def step(model, optimizer, scaler, x, y) -> float:
    t0 = time.perf_counter()
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return time.perf_counter() - t0


def measure(options, steps, db) -> tuple:
    """(median step without ampdiag, with it), seconds."""
    plain, watched = loop(), loop()
    handle = ampdiag.attach(watched[0], watched[2], db=db, **options)
    try:
        times = ([], [])
        for _ in range(50):  # warm-up, the first steps' one-off work included
            step(*plain), step(*watched)
        for i in range(steps):
            if i % 2:
                times[0].append(step(*plain))
                times[1].append(step(*watched))
            else:
                times[1].append(step(*watched))
                times[0].append(step(*plain))
    finally:
        handle.close()
    return statistics.median(times[0]), statistics.median(times[1])


def calls_per_step(loop_state, steps=100) -> float:
    """The Python and built-in function calls one step makes (sys.setprofile's "call" and
    "c_call" events), averaged over `steps` steps."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        for _ in range(steps):
            step(*loop_state)
    finally:
        sys.setprofile(None)
    return calls / steps


def count_calls(options, db) -> tuple:
    """(calls a step without ampdiag, with it)."""
    plain, watched = loop(), loop()
    handle = ampdiag.attach(watched[0], watched[2], db=db, **options)
    try:
        for _ in range(50):  # past the first steps' one-off work, as measure()
            step(*plain), step(*watched)
        return calls_per_step(plain), calls_per_step(watched)
    finally:
        handle.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 10 or args.repeat < 1:
        parser.error("--steps must be at least 10 and --repeat at least 1")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 thread; tiny MLP 8-8-8-1, batch 4, fp32; "
          f"{args.steps} interleaved steps per measurement.\n")
    print("| attach() | step without ampdiag, µs | with, µs | cost per step, µs | cost / step |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for name, options in SETTINGS:
                without, with_agent = measure(options, args.steps, Path(tmp) / f"{r}-{len(name)}.db")
                print(f"| {name} | {without * 1e6:.0f} | {with_agent * 1e6:.0f} | {(with_agent - without) * 1e6:.0f} | "
                      f"{with_agent / without - 1:.3f} |")
        print("\n| attach() | calls a step without ampdiag | with | added |")
        print("|---|---:|---:|---:|")
        for name, options in SETTINGS:
            without, with_agent = count_calls(options, Path(tmp) / f"calls-{len(name)}.db")
            print(f"| {name} | {without:.0f} | {with_agent:.0f} | {with_agent - without:.0f} |")


if __name__ == "__main__":
    main()
