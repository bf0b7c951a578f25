"""Where attach()'s cost falls in a training step, phase by phase, and what each kind of
hook adds, measured by taking it away: the MLP of python_attach_bench.py at one width
(384 by default, about 2 ms a step on the CPUs measured), trained in these loops, each in
turns of 10 consecutive steps (the first untimed), the turns rotating:

  - without ampdiag;
  - attach() as shipped (activations on);
  - attach() with the watched modules' forward hooks making no pass over the outputs (the
    engine's NaN/Inf check or statistics replaced by nothing; the rest of the hook runs);
  - attach() with the model's own pre- and forward hooks doing nothing but open the step's
    cycle (the output's gradient watch, the inputs kept, the output looked at: gone);
  - both of the above: hook dispatch and the cycle only;
  - attach(activations=False).

A step is timed in five phases: zero_grad(), the forward with the loss, backward(),
scaler.step(), scaler.update(). The table gives each phase's median and its difference
from the loop without ampdiag. The emptied hooks are ampdiag's own (module-level
factories replaced before attach()), so the variants measure the shipped code minus one
part, not a model of it. (Emptying the module hooks alone is not such a variant: the
model's forward hook then takes the output for one the model computed after its last
module, and looks at it as such.) Precision fp32 with the same GradScaler (autocast off), as
python_attach_bench.py --precision fp32 on a CPU that emulates fp16.

    PYTHONPATH=build/python python bench/python_attach_phases.py [--width W] [--turns N] [--precision fp16|fp32]
"""
import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ampdiag
import ampdiag._attach as attach_module
from python_attach_bench import mlp_of  # the same MLP, optimizer and batch (this script's folder is on the path)

SHIPPED = (attach_module.forward_hook, attach_module.input_hook, attach_module.output_hook)
PHASES = ("zero_grad", "forward + loss", "backward", "scaler.step", "scaler.update", "step")


class _NoPass:
    """The session as a module hook binds it, with the pass over an output made a no-op."""

    def __init__(self, session):
        self._session = session

    def activation(self, *args):
        return False

    def __getattr__(self, name):
        return getattr(self._session, name)


def passless_module_hook(handle, path, owner, root):
    session = handle._session
    handle._session = _NoPass(session)  # read once, when the hook is made
    try:
        return SHIPPED[0](handle, path, owner, root)
    finally:
        handle._session = session


def empty_module_hook(handle, path, owner, root):
    def hook(module, args, kwargs, output):
        return None

    return hook


def cycle_only_pre_hook(handle, owner):
    def hook(module, args, kwargs):
        if not handle._live and torch.is_grad_enabled():
            handle._begin_forward_cycle()
        return None

    return hook


def empty_output_hook(handle, owner):
    def hook(module, args, kwargs, output):
        return None

    return hook


LOOPS = (
    ("without ampdiag", None, SHIPPED),
    ("attach (activations on)", {}, SHIPPED),
    ("module hooks without the pass over outputs", {}, (passless_module_hook, SHIPPED[1], SHIPPED[2])),
    ("model's hooks only open the cycle", {}, (SHIPPED[0], cycle_only_pre_hook, empty_output_hook)),
    ("both: dispatch and the cycle only", {}, (empty_module_hook, cycle_only_pre_hook, empty_output_hook)),
    ("attach, no activations", {"activations": False}, SHIPPED),
)


def step(model, optimizer, scaler, x, y, autocast):
    now = time.perf_counter_ns
    t0 = now()
    optimizer.zero_grad()
    t1 = now()
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = nn.functional.mse_loss(model(x).float(), y)
    t2 = now()
    scaler.scale(loss).backward()
    t3 = now()
    scaler.step(optimizer)
    t4 = now()
    scaler.update()
    t5 = now()
    return (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)


def check_variants_took_effect(tmp: Path):
    """The shipped loop records activation rows and the pass-less one none: a renamed factory
    in ampdiag._attach would otherwise leave every variant measuring the shipped code."""
    def rows(i):
        with sqlite3.connect(tmp / f"loop{i}.db") as db:
            return db.execute("SELECT COUNT(*) FROM act_stats").fetchone()[0]

    shipped, passless = rows(1), rows(2)
    if shipped == 0 or passless != 0:
        raise SystemExit(f"the variants did not take effect ({shipped} activation rows shipped, {passless} without "
                         "the pass): do ampdiag._attach's hook factories still have the names this script replaces?")


def mlp_options(description: str, width: int, precision: str, least_turns: int) -> argparse.Namespace:
    """The command line of a benchmark that trains the MLP in turns: --width, --turns,
    --precision, with these defaults, checked."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--width", type=int, default=width, help=f"the MLP's width (default {width})")
    parser.add_argument("--turns", type=int, default=60, help="turns of 10 steps per loop (default 60)")
    parser.add_argument("--precision", choices=("fp16", "fp32"), default=precision)
    args = parser.parse_args()
    if args.width < 1 or args.turns < least_turns:
        parser.error(f"--width must be at least 1 and --turns at least {least_turns}")
    return args


def main():
    args = mlp_options(__doc__.splitlines()[0], 384, "fp32", 4)
    autocast = args.precision == "fp16"
    loops = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, options, hooks) in enumerate(LOOPS):
            torch.manual_seed(0)
            model, optimizer, x, y = mlp_of(args.width)("cpu")
            scaler = torch.amp.GradScaler("cpu")
            handle = None
            if options is not None:
                attach_module.forward_hook, attach_module.input_hook, attach_module.output_hook = hooks
                try:
                    handle = ampdiag.attach(model, scaler, db=Path(tmp) / f"loop{i}.db", **options)
                finally:
                    attach_module.forward_hook, attach_module.input_hook, attach_module.output_hook = SHIPPED
            loops.append((name, model, optimizer, scaler, x, y, handle, []))
        for turn in range(args.turns):
            k = turn % len(loops)
            for name, model, optimizer, scaler, x, y, handle, times in loops[k:] + loops[:k]:
                for i in range(10):
                    t = step(model, optimizer, scaler, x, y, autocast)
                    if i > 0 and turn >= 3:  # the first of a turn inherits another loop's caches
                        times.append(t)
        for loop in loops:
            if loop[6] is not None:
                loop[6].close()
        check_variants_took_effect(Path(tmp))
    base = [statistics.median(t[p] for t in loops[0][7]) / 1e3 for p in range(len(PHASES))]
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; MLP 256-{args.width}-{args.width}-"
          f"{args.width}-1, batch 128, {args.precision}; {len(loops[0][7])} timed steps per loop.\n")
    print("| loop | " + " | ".join(PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for name, *_, times in loops:
        medians = [statistics.median(t[p] for t in times) / 1e3 for p in range(len(PHASES))]
        cells = [f"{m:.1f}" if name == loops[0][0] else f"{m - b:+.1f}" for m, b in zip(medians, base)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nµs: the loop without ampdiag as medians, the others as differences from it.")


if __name__ == "__main__":
    main()
