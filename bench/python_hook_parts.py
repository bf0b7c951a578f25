"""What one module hook of attach() costs on a device, by part: a deep MLP (DEPTH x
(Linear, ReLU) and a head, fp16 autocast, a real GradScaler) trained in five copies whose
steps are interleaved in a new random order each round, so that no copy always runs
after the same one:

  - without ampdiag;
  - attach(activations=False);
  - attach() with the hook's engine call replaced by nothing (the hook's own Python);
  - attach() with the engine call replaced by reading where the tensor lives (fast_place);
  - attach() as shipped.

The differences between the last three, over the number of hooks, are the hook's parts.
The replacement is of `ampdiag._forward.activation_elsewhere`, the path of a device
output; a host output takes the hook's inline path, so on the CPU the three rows measure
the same code (their spread is the noise). With --profile, cProfile then lists the
agent's own functions over ten steps of a BERT-sized encoder (d=768, 12 layers, 16 x 256
tokens): calls, own time, time a call. cProfile sees the calling thread only: what hooks
cost on autograd's device thread (CUDA backward) is not in it. Also prints the host-side
cost of launching a tiny operation, the floor of any per-hook launch on that machine.

    PYTHONPATH=build/python python bench/python_hook_parts.py [--device cuda] [--rounds N] [--profile]
"""
import argparse
import cProfile
import os
import pstats
import random
import statistics
import tempfile
import time

import torch
from torch import nn

import ampdiag
import ampdiag._forward as forward
import ampdiag._tensors as tensors


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def launch_cost(device) -> float:
    """Seconds of host time a tiny in-place operation takes to launch (or run, on the CPU)."""
    x = torch.zeros(16, device=device)
    for _ in range(200):
        x.add_(1)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    elapsed = time.perf_counter() - t0
    synchronize(device)
    return elapsed / 2000


def placement_only(session, module_id, tensor, micro_batch):
    tensors.fast_place(tensor)
    return False


def nothing(session, module_id, tensor, micro_batch):
    return False


VARIANTS = (("without ampdiag", None, None), ("attach, no activations", {"activations": False}, None),
            ("attach, hook without its engine call", {}, nothing),
            ("attach, hook + reading where the output lives", {}, placement_only),
            ("attach (as shipped)", {}, forward.activation_elsewhere))


def hook_parts(device, depth, width, batch, rounds, tmp):
    shipped = forward.activation_elsewhere
    loops = []
    for k, (name, options, elsewhere) in enumerate(VARIANTS):
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 1)).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device)
        handle = None if options is None else ampdiag.attach(model, scaler, db=os.path.join(tmp, f"parts{k}.db"),
                                                             overwrite=True, **options)
        loops.append((name, model, optimizer, scaler, handle, elsewhere, []))
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, 1, device=device)
    order = list(loops)
    shuffle = random.Random(0)
    try:
        for r in range(rounds + 10):  # the first 10 rounds warm up
            shuffle.shuffle(order)
            for name, model, optimizer, scaler, handle, elsewhere, times in order:
                forward.activation_elsewhere = elsewhere or shipped
                synchronize(device)
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device, dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                synchronize(device)
                if r >= 10:
                    times.append(time.perf_counter() - t0)
    finally:
        forward.activation_elsewhere = shipped
        for loop in loops:
            if loop[4] is not None:
                loop[4].close()
    hooks = 2 * depth + 1
    medians = {name: statistics.median(times) for name, *_, times in loops}
    base, no_activations = medians["without ampdiag"], medians["attach, no activations"]
    print(f"\n### Deep MLP: {depth} x (Linear({width}), ReLU) + head, batch {batch}, {hooks} module hooks; "
          f"medians of {rounds} rounds\n")
    print("| loop | median step ms | against without ampdiag | a module hook, µs (over no activations) |")
    print("|---|---:|---:|---:|")
    for name, options, _ in VARIANTS:
        per_hook = f"{(medians[name] - no_activations) / hooks * 1e6:.1f}" if options == {} else ""
        print(f"| {name} | {medians[name] * 1e3:.3f} | {medians[name] / base - 1:+.1%} | {per_hook} |")
    if device == "cpu":
        print("\nOn the CPU a host output takes the hook's inline path: the last three rows run the same code, "
              "and their spread is the noise.")


def profile_encoder(device, tmp):
    d, layers, batch, tokens = (768, 12, 16, 256) if device == "cuda" else (256, 6, 8, 32)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, 12 if d == 768 else 4, 4 * d, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(d, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device)
    x = torch.randn(batch, tokens, d, device=device)

    def steps(n):
        for _ in range(n):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        synchronize(device)

    with ampdiag.attach(model, scaler, db=os.path.join(tmp, "encoder.db"), overwrite=True):
        steps(5)
        t0 = time.perf_counter()
        steps(10)
        unprofiled = (time.perf_counter() - t0) / 10
        profile = cProfile.Profile()
        profile.enable()
        steps(10)
        profile.disable()
    print(f"\n### cProfile: encoder d={d}, {layers} layers, batch {batch} x {tokens}, attach() with activations "
          f"({unprofiled * 1e3:.2f} ms a step unprofiled); the agent's functions by own time, 10 steps\n")
    print("| own ms | calls | µs a call | with callees, ms | function |")
    print("|---:|---:|---:|---:|---|")
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])
    shown = 0
    for (path, line, function), (_, calls, own, total, _) in rows:
        if ("ampdiag" + os.sep + "_") in path and shown < 30:
            print(f"| {own * 1e3:.2f} | {calls} | {own / calls * 1e6:.2f} | {total * 1e3:.2f} | "
                  f"{os.path.basename(path)}:{line}({function}) |")
            shown += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--depth", type=int, default=48)
    parser.add_argument("--profile", action="store_true", help="also cProfile the agent on a BERT-sized encoder")
    args = parser.parse_args()
    if args.rounds < 5 or args.depth < 1:
        parser.error("--rounds must be at least 5 and --depth at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {name}. A tiny operation takes {launch_cost(args.device) * 1e6:.2f} µs "
          "of host time to launch.")
    with tempfile.TemporaryDirectory() as tmp:
        hook_parts(args.device, args.depth, 256, 64, args.rounds, tmp)
        if args.profile:
            profile_encoder(args.device, tmp)


if __name__ == "__main__":
    main()
