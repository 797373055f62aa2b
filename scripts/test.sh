#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# The studio's browser test drives Debian's chromium (Playwright with executable_path; nothing downloaded).
if ! command -v chromium >/dev/null 2>&1 && [ -z "${AIDAPTIV_CHROMIUM:-}" ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "test: installing Debian's chromium for the studio's browser test"
  if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null; }; then
    echo "test: chromium could not be installed; the studio's browser test will be skipped (it says why)"
  fi
fi
venv=${AIDAPTIV_VENV:-.venv}
# DeepSpeed builds its CPU Adam and async_io ops just in time; keep them between runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
exec "$venv/bin/python" -m pytest tests "$@"
