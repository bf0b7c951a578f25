"""The `ampdiag` console command installed with the package: runs the bundled C++ CLI."""
import os
import sys
from pathlib import Path


def main() -> None:
    binary = Path(__file__).with_name("bin") / "ampdiag"
    if not binary.exists():
        sys.exit(f"ampdiag: the bundled CLI is missing at {binary}; reinstall the package")
    os.execv(binary, [str(binary), *sys.argv[1:]])


if __name__ == "__main__":
    main()
