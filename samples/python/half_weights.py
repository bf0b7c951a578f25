"""Fitting a teacher network with a pure fp16 model (model.half(), SGD with momentum, no FP32
master weights), as the Apex-era O2/O3 guides warned against. Most updates are smaller than
half a unit in the last place of their weight, so they round away and the loss stops falling
early. `--fp32-master` trains the same model the torch.amp way (FP32 parameters, fp16
autocast, a GradScaler), where every update lands.

    python samples/python/half_weights.py --db half.db && ampdiag report half.db
"""
import torch
from torch import nn

import ampdiag
from _sample import Summary, parse_args, run

INPUTS, WIDTH, BATCH = 64, 256, 512


def main():
    args = parse_args(__doc__.splitlines()[0], "half_weights.db", 200, [],
                      {"--fp32-master": "keep FP32 parameters and train under fp16 autocast with a GradScaler"})
    torch.manual_seed(args.seed)
    teacher = nn.Sequential(nn.Linear(INPUTS, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    model = nn.Sequential(nn.Linear(INPUTS, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    x = torch.randn(BATCH, INPUTS)
    with torch.no_grad():
        target = teacher(x)
    if not args.fp32_master:
        model = model.half()  # before the optimizer: it then updates the fp16 tensors themselves
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu") if args.fp32_master else None
    summary = Summary()
    with ampdiag.attach(model, scaler, optimizer=optimizer, db=args.db, overwrite=True) as handle:
        for _ in range(args.steps):
            optimizer.zero_grad()
            if scaler is None:
                loss = nn.functional.mse_loss(model(x.half()).float(), target)
                loss.backward()
                optimizer.step()
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), target)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            summary.step(loss.item(), handle.last_step_skipped, scaler.get_scale() if scaler else 1.0)
    summary.print("half_weights", args, handle)


if __name__ == "__main__":
    run(main)
