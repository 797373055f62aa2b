"""A checkpoint written by aidaptiv-ds before the package moved into wings (the last commit of the flat
layout) resumes in today's package on the trajectory the old run was on.

The old package is taken from this repository's history (``git archive``), given today's compiled engine
(the C++ sources are the same; only comments changed with the move), and run as its own process; then
today's ``aidaptiv-ds train`` resumes from its step-2 tag. Nothing of a checkpoint names a Python module, so
the move must not matter; this test is what says so.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from helpers import CONFIGS, REPO, child_env, read_metrics, run_train

# The last commit before the wings (house/moves.txt): aidaptiv_ds/ was flat, the engine aidaptiv_ds._C.
FLAT_LAYOUT = "b6fbb5f194a53ef88b8aebba1bf0e75747ca5c45"
STEPS, SAVE_AT = 4, 2
COMMON = ["--model", "micro", "--seq-len", "64", "--warmup", "0", "--no-progress", "--steps", str(STEPS)]


def flat_package(dest) -> str:
    """The flat-layout package as a folder to put first on PYTHONPATH, with today's engine in it."""
    try:
        archive = subprocess.run(
            ["git", "-C", REPO, "archive", "--format=tar", FLAT_LAYOUT, "aidaptiv_ds"],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(
            f"the flat-layout commit {FLAT_LAYOUT[:10]} is not in this checkout's history ({e}): a shallow clone"
        )
    dest.mkdir(parents=True, exist_ok=True)
    tar = dest / "flat.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    engines = glob.glob(os.path.join(REPO, "aidaptiv_ds", "engine", "_C*.so"))
    assert engines, "the engine is not built in this checkout (scripts/setup.sh builds it)"
    shutil.copy(engines[0], dest / "aidaptiv_ds" / os.path.basename(engines[0]))
    return str(dest)


def test_a_checkpoint_of_the_flat_layout_resumes_in_the_wings(tmp_path):
    old = flat_package(tmp_path / "old")
    (tmp_path / "swap_old").mkdir()
    (tmp_path / "swap_new").mkdir()
    metrics_old = tmp_path / "old.json"
    cmd = [
        sys.executable,
        "-m",
        "aidaptiv_ds",
        "train",
        "--config",
        os.path.join(CONFIGS, "aidaptiv.json"),
        *COMMON,
        "--save-dir",
        str(tmp_path / "ck"),
        "--save-every",
        str(SAVE_AT),
        "--nvme-path",
        str(tmp_path / "swap_old"),
        "--metrics-out",
        str(metrics_old),
    ]
    env = child_env()
    env["PYTHONPATH"] = old  # the old package, not this checkout's
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (
        "old"
        in subprocess.run(
            [sys.executable, "-c", "import aidaptiv_ds, os; print(os.path.dirname(aidaptiv_ds.__file__))"],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp_path,
        ).stdout
    ), "the flat-layout run did not use the old package"
    full = read_metrics(metrics_old)

    metrics_new = tmp_path / "new.json"
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "aidaptiv.json"),
            *COMMON,
            "--resume-from",
            str(tmp_path / "ck" / f"step{SAVE_AT}"),
            "--nvme-path",
            str(tmp_path / "swap_new"),
            "--metrics-out",
            str(metrics_new),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    assert f"at step {SAVE_AT}" in log
    resumed = read_metrics(metrics_new)
    assert resumed["first_step"] == SAVE_AT and len(resumed["losses"]) == STEPS
    assert resumed["losses"][:SAVE_AT] == full["losses"][:SAVE_AT]
    assert resumed["losses"][SAVE_AT:] == pytest.approx(full["losses"][SAVE_AT:], rel=1e-5, abs=0)
    assert resumed["lr_final"] == full["lr_final"]
