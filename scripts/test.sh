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
# tests/cluster/ runs a real SLURM cluster on this machine (scripts/cluster.sh): Debian's SLURM, munge, sshd
# and pdsh. Without them (or without root) those tests skip and say what is missing.
missing=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge sshd:openssh-server pdsh:pdsh; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" -eq 0 ]; then
  echo "test: installing ${missing[*]} for the SLURM cluster tests (tests/cluster/)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
    echo "test: ${missing[*]} could not be installed; the cluster tests will be skipped (they say why)"
  fi
fi
venv=${AIDAPTIV_VENV:-.venv}
# DeepSpeed builds its CPU Adam and async_io ops just in time; keep them between runs, and build them once
# here (minutes on a fresh clone), so that a failed build is said once, up front, instead of in whichever test
# first needs an op, and the tests' durations are the tests'.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
echo "test: building DeepSpeed's just-in-time ops (cached in $TORCH_EXTENSIONS_DIR)"
"$venv/bin/python" -c 'import os
from aidaptiv_ds.harness.prebuild import OPS, prebuild, put_build_tools_first
env = dict(os.environ)
put_build_tools_first(env)  # the ninja the tests build with (tests/conftest.py): no rebuild in the tests
for line in prebuild(set(OPS), env):
    print("test:", line)'
exec "$venv/bin/python" -m pytest tests "$@"
