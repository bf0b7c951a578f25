"""The ViT sample under DistributedDataParallel with the gloo backend, one run.db per
rank. Run it with torchrun:

    torchrun --nproc_per_node=2 samples/python/ddp_vit.py --db ddp.db
    ampdiag report ddp.rank0.db ddp.rank1.db
"""
import os

import torch
import torch.distributed as dist
from torch import nn

import ampdiag
from _sample import Summary, parse_args, run
from vit_overflow import BATCH, DIM, TOKENS, Vit


def main():
    args = parse_args(__doc__.splitlines()[0], "ddp_vit.db", 30, ["block1.0.attn", "head"])
    if "RANK" not in os.environ:
        raise SystemExit("run this sample with torchrun, e.g. torchrun --nproc_per_node=2 samples/python/ddp_vit.py")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(Vit())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of data
    inputs, targets = torch.randn(BATCH, TOKENS, DIM, generator=generator), torch.randn(BATCH, 1, generator=generator)
    pins = ["module." + p for p in args.pin_fp32]
    summary = Summary()
    with ampdiag.attach(model, scaler, db=args.db, overwrite=True, pins=pins) as handle:
        for _ in range(args.steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(inputs).float(), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scale = scaler.get_scale()  # after update(), as the report shows it
            summary.step(loss.item(), handle.last_step_skipped, scale)
    if rank == 0:
        summary.print("ddp_vit (rank 0)", args, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
