# Sourced by the scripts: where the Python environment and the build live.
AMPDIAG_VENV="${AMPDIAG_VENV:-/opt/ampdiag/venv}"
AMPDIAG_BUILD="${AMPDIAG_BUILD:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build}"
AMPDIAG_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export AMPDIAG_VENV AMPDIAG_BUILD AMPDIAG_ROOT
