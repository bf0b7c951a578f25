"""What the Python samples share: their command line and the end-of-run summary."""
import argparse
import math
import os
import sys

import ampdiag


def parse_args(description: str, default_db: str, default_steps: int, pinnable: list,
               flags: dict = None) -> argparse.Namespace:
    """flags: extra on/off options of the sample, {"--name": "help"}."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--db", default=default_db, help=f"run.db to write (default {default_db}; replaced if it exists)")
    parser.add_argument("--steps", type=int, default=default_steps, help=f"training steps (default {default_steps})")
    if pinnable:
        parser.add_argument("--pin-fp32", action="append", default=[], choices=pinnable, metavar="MODULE",
                            help="run MODULE in FP32 (autocast off, fp32 inputs); one of: " + ", ".join(pinnable))
    else:
        parser.set_defaults(pin_fp32=[])
    for flag, help_text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=help_text)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


class Summary:
    def __init__(self):
        self.losses, self.skipped, self.scales = [], 0, []

    def step(self, loss: float, skipped: bool, scale: float) -> None:
        self.losses.append(loss)
        self.skipped += skipped
        self.scales.append(scale)

    def print(self, name: str, args, handle) -> None:
        bad = sum(1 for x in self.losses if not math.isfinite(x))
        print(f"{name}: pinned to fp32: {', '.join(args.pin_fp32) or 'nothing'}")
        print(f"  steps {len(self.losses)}, skipped {self.skipped}, non-finite losses {bad}")
        print(f"  loss {self.losses[0]:.4g} -> {self.losses[-1]:.4g}, loss scale now {self.scales[-1]:g} "
              f"(lowest {min(self.scales):g})")
        status = handle.status
        lost = f", {status['lost']} lost to a write error: {status['first_error']}" if status["write_errors"] else ""
        print(f"  run.db: {handle.db_path} ({status['rows_written']} rows, {status['dropped']} dropped{lost})"
              f"  ->  ampdiag report {handle.db_path}")


def run(main) -> None:
    """Runs a sample's main(); a run.db that cannot be created is one line and exit 2,
    not a traceback."""
    try:
        main()
    except ampdiag.RunDbError as e:
        print(f"{os.path.basename(sys.argv[0])}: {e}", file=sys.stderr)
        sys.exit(2)
