"""What torch's dispatch to a module's forward hook costs, against the same Python body run
by a wrapper of the module's forward (an instance attribute `forward`, which torch calls on
its fast path, with no hooks to look up). The body is empty in both, so the difference is
the dispatch alone: the most that replacing attach()'s module hooks by forward wrappers
could save a module call (docs/PERFORMANCE.md, "Forward wrappers instead of hooks").

A Linear(8, 8) on 4 rows, forward only, one thread: its kernel is small, so the dispatch
is most of the call. The variants run in turn, blocks of --calls calls, --rounds rounds;
the table gives each block's median µs a call and its difference from the bare module.

    python bench/python_hook_dispatch.py [--rounds N] [--calls N]
"""
import argparse
import statistics
import time
import types

import torch


def body(module, output):
    return None


def make(kind: str) -> torch.nn.Module:
    module = torch.nn.Linear(8, 8)
    if kind == "forward hook":
        module.register_forward_hook(lambda m, args, output: body(m, output))
    elif kind == "forward hook, with_kwargs":  # what attach() registers
        module.register_forward_hook(lambda m, args, kwargs, output: body(m, output), with_kwargs=True)
    elif kind == "forward wrapper":
        def forward(self, *args, **kwargs):
            output = type(self).forward(self, *args, **kwargs)
            body(self, output)
            return output

        module.forward = types.MethodType(forward, module)  # bound, so a deepcopy binds its copy
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--calls", type=int, default=200)
    options = parser.parse_args()
    if options.rounds < 1 or options.calls < 1:
        parser.error("--rounds and --calls must be at least 1")
    torch.set_num_threads(1)
    kinds = ["bare", "forward hook", "forward hook, with_kwargs", "forward wrapper"]
    modules = {kind: make(kind) for kind in kinds}
    x = torch.randn(4, 8)
    times = {kind: [] for kind in kinds}
    for _ in range(options.rounds):  # gradients on, as in training: each call records its graph
        for kind in kinds:
            module = modules[kind]
            start = time.perf_counter_ns()
            for _ in range(options.calls):
                module(x)
            times[kind].append((time.perf_counter_ns() - start) / options.calls / 1000)
    bare = statistics.median(times["bare"])
    print(f"torch {torch.__version__}, Linear(8, 8) forward, {options.rounds} rounds of {options.calls} calls\n")
    print("| module | µs a call (median) | over the bare module |")
    print("|---|---:|---:|")
    for kind in kinds:
        median = statistics.median(times[kind])
        print(f"| {kind} | {median:.2f} | {median - bare:+.2f} |")


if __name__ == "__main__":
    main()
