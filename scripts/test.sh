#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
venv=${AIDAPTIV_VENV:-.venv}
# DeepSpeed builds its CPU Adam and async_io ops just in time; keep them between runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
exec "$venv/bin/python" -m pytest tests "$@"
