#!/usr/bin/env bash
# Sets up everything aidaptiv-ds needs on a fresh Debian/Ubuntu machine, and is cheap to re-run:
#   system packages (liburing-dev for our engine, libaio-dev for DeepSpeed's baseline handle, fio for
#   io-bench), a virtual environment in .venv (override with AIDAPTIV_VENV), torch 2.13.0, DeepSpeed
#   0.19.8 built against that torch, the pinned Python packages, and aidaptiv_ds with its C++ engine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${AIDAPTIV_VENV:-.venv}
python=${PYTHON:-python3}

missing=()
for pkg in liburing-dev libaio-dev fio; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "setup: installing system packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# pip before 23.1 (Debian 12's python3 venv has 23.0.1) installs a project without pyproject.toml in editable
# mode through `setup.py develop`, which setuptools >= 80 hands to a nested pip with build isolation, where
# torch is missing and the engine cannot build; newer pip uses the PEP 660 hooks in this environment.
"${pip[@]}" "pip>=23.1"
# torch first and alone: 2.13.0 is a local CPU build here; any other version pulls CUDA packages.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -r requirements.txt
# DeepSpeed ships only an sdist; build it against the torch installed above.
"${pip[@]}" --no-build-isolation deepspeed==0.19.8
# Editable: the C++ engine (aidaptiv_ds/_C*.so) is built into the source tree, so the tests, which run from
# the checkout (python -m pytest puts it first on sys.path), import the package together with its engine.
"${pip[@]}" --no-build-isolation --no-deps -e .
# The start-up hook that lets unmodified deepspeed/HF programs honour the "aidaptiv" block (a wheel install
# puts it in place itself; an editable one does not).
cp aidaptiv_ds_autoload.pth "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
echo "setup: ready ($venv/bin/aidaptiv-ds)"
