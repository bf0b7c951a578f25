"""Records the real torch.amp.GradScaler's trajectory for the C++ port's test.

Usage: python gradscaler_trajectory.py OUT.csv

A fixed sequence of scaled gradients, some with Inf or NaN planted, goes through
scaler.step(optimizer) / scaler.update(); each row holds what the test compares: the
scale before and after, whether the step was skipped, the growth tracker, and the bits of
the parameters after the step. tests/agent/test_scaler_vs_torch.cpp builds the same
gradients with the same formula (keep the two in step).
"""
import struct
import sys

import torch

STEPS = 40
INF_STEPS = {3, 4, 5, 11, 25}
NAN_STEPS = {7, 20, 26}


def grad_values(step: int) -> list[float]:
    base = (step % 5 + 1) * 0.25
    values = [base, -base * 0.5, base * 3.0, 1e-3]
    if step in INF_STEPS:
        values[1] = float("inf")
    if step in NAN_STEPS:
        values[2] = float("nan")
    return values


def bits(x: float) -> str:
    return format(struct.unpack("<I", struct.pack("<f", x))[0], "08x")


def main(out_path: str) -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    with open(out_path, "w") as out:
        out.write("step,scale_before,skipped,scale_after,growth_tracker,p0,p1,p2,p3\n")
        for step in range(STEPS):
            optimizer.zero_grad()
            scaler.scale(torch.ones(()))  # initialises the scale, as scale(loss) does
            scale_before = scaler.get_scale()
            param.grad = torch.tensor(grad_values(step), dtype=torch.float32) * scale_before
            before = param.detach().clone()
            scaler.step(optimizer)
            skipped = torch.equal(before, param.detach()) and any(
                v != v or v in (float("inf"), float("-inf")) for v in grad_values(step))
            scaler.update()
            p = [bits(v) for v in param.detach().tolist()]
            out.write(f"{step},{scale_before!r},{int(skipped)},{scaler.get_scale()!r},"
                      f"{scaler._get_growth_tracker()},{','.join(p)}\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: gradscaler_trajectory.py OUT.csv")
    main(sys.argv[1])
