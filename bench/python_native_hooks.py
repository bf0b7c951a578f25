"""What hooks that are not Python would save a training step, measured before anyone builds them.

docs/PERFORMANCE.md names that lever for issue 11's item 5 ("hooks that are not Python").
No ampdiag runs in the loops (its package is imported only for the MLP of
python_attach_bench.py): every hook's body is empty or one counter, so the differences are
torch's dispatch to the hooks, which no body can remove.

The MLP of python_attach_bench.py (256-W-W-W-1, batch 128, AdamW, torch's GradScaler),
trained in these loops, in turns of 10 consecutive steps (the first untimed), rotating:

  - no hooks;
  - a Python gradient hook on every parameter (`tensor.register_hook`), as attach()'s
    arrival hooks are, each a Python function that returns at once;
  - a C++ gradient hook on every parameter, registered by a small extension compiled at
    start (`at::Tensor::register_hook`, a lambda that counts): the autograd engine calls
    it without the GIL or any Python object;
  - a Python forward hook (`with_kwargs=True`, as attach() registers) on every module;
  - the same forward hooks with a C++ function as the hook: torch's Module call still
    finds and calls it from Python, so only the hook's own frame is native.

The table gives each loop's median forward (with the loss), backward and whole step, the
differences from the loop without hooks, and what one hook costs: the difference in the
phase where the hooks run (backward for gradient hooks, forward for module hooks) divided
by the hooks a step calls. The whole step's difference is noisier than that phase's.
Compiling the extension needs a C++ compiler and ninja, and takes about a minute the first
time (torch caches it).

    PYTHONPATH=build/python python bench/python_native_hooks.py [--width W] [--turns N] [--precision fp16|fp32]
"""
import statistics

import torch
from torch.utils.cpp_extension import load_inline

from python_attach_bench import mlp_of  # the same MLP, optimizer and batch (this script's folder is on the path)
from python_attach_phases import PHASES, mlp_options, step  # the same step and options

_SOURCE = r"""
#include <atomic>
#include <torch/extension.h>

namespace {
std::atomic<long long> calls{0};
}

void add_gradient_hooks(const std::vector<at::Tensor>& parameters) {
  for (const auto& parameter : parameters) {
    parameter.register_hook([](const at::Tensor&) { calls.fetch_add(1, std::memory_order_relaxed); });
  }
}

void forward_hook(pybind11::handle, pybind11::handle, pybind11::handle, pybind11::handle) {
  calls.fetch_add(1, std::memory_order_relaxed);
}

long long hook_calls() { return calls.load(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_gradient_hooks", &add_gradient_hooks);
  m.def("forward_hook", &forward_hook);
  m.def("hook_calls", &hook_calls);
}
"""

KINDS = ("no hooks", "python gradient hooks", "C++ gradient hooks", "python forward hooks",
         "forward hooks, C++ function")
PARTS = ("forward + loss", "backward", "step")  # of PHASES: where the hooks run, and the whole step
PICKED = [PHASES.index(part) for part in PARTS]


def empty_gradient_hook(grad):
    return None


def empty_forward_hook(module, args, kwargs, output):
    return None


def hooked(kind, model, native):
    """Registers `kind`'s hooks on `model`; returns how many a step calls."""
    if kind == "python gradient hooks" or kind == "C++ gradient hooks":
        parameters = list(model.parameters())
        if kind == "python gradient hooks":
            for p in parameters:
                p.register_hook(empty_gradient_hook)
        else:
            native.add_gradient_hooks(parameters)
        return len(parameters)
    if kind == "python forward hooks" or kind == "forward hooks, C++ function":
        modules = list(model.modules())
        hook = empty_forward_hook if kind == "python forward hooks" else native.forward_hook
        for module in modules:
            module.register_forward_hook(hook, with_kwargs=True)
        return len(modules)
    return 0


def main():
    # 64 wide: about 2 ms a step in fp16 on a CPU that multiplies fp16 natively.
    args = mlp_options(__doc__.splitlines()[0], 64, "fp16", len(KINDS) + 1)
    autocast = args.precision == "fp16"
    native = load_inline("ampdiag_bench_native_hooks", cpp_sources=_SOURCE, extra_cflags=["-O2"])
    loops = []
    for kind in KINDS:
        torch.manual_seed(0)
        model, optimizer, x, y = mlp_of(args.width)("cpu")
        loops.append((kind, hooked(kind, model, native), model, optimizer, torch.amp.GradScaler("cpu"), x, y, []))
    for turn in range(args.turns):
        k = turn % len(loops)
        for kind, _, model, optimizer, scaler, x, y, times in loops[k:] + loops[:k]:
            for i in range(10):
                t = step(model, optimizer, scaler, x, y, autocast)
                if i > 0 and turn >= len(loops):  # the first of a turn inherits another loop's caches
                    times.append([t[p] for p in PICKED])
    # A hook torch never called measures nothing: one more step of each loop with C++ hooks.
    native_loops = [loop for loop in loops if "C++" in loop[0]]
    before = native.hook_calls()
    for _, _, model, optimizer, scaler, x, y, _ in native_loops:
        step(model, optimizer, scaler, x, y, autocast)
    expected = sum(loop[1] for loop in native_loops)
    if native.hook_calls() - before != expected:
        raise SystemExit(f"the C++ hooks ran {native.hook_calls() - before} times in a step of each of their loops, "
                         f"not {expected}")
    base = [statistics.median(t[p] for t in loops[0][7]) / 1e3 for p in range(len(PARTS))]
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; MLP 256-{args.width}-{args.width}-"
          f"{args.width}-1, batch 128, {args.precision}; {len(loops[0][7])} timed steps per loop.\n")
    print("| loop | hooks a step | " + " | ".join(PARTS) + " | one hook |")
    print("|---|---:|" + "---:|" * (len(PARTS) + 1))
    for kind, count, *_, times in loops:
        medians = [statistics.median(t[p] for t in times) / 1e3 for p in range(len(PARTS))]
        if count == 0:
            print(f"| {kind} | 0 | " + " | ".join(f"{m:.1f}" for m in medians) + " | |")
        else:
            cells = [f"{m - b:+.1f}" for m, b in zip(medians, base)]
            phase = PARTS.index("backward" if "gradient" in kind else "forward + loss")
            print(f"| {kind} | {count} | " + " | ".join(cells) + f" | {(medians[phase] - base[phase]) / count:+.2f} |")
    print("\nµs: the loop without hooks as medians, the others as differences from it; one hook: the difference in "
          "the phase where the hooks run divided by the hooks a step calls.")


if __name__ == "__main__":
    main()
