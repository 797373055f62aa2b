"""ruff (pyproject.toml's [tool.ruff]) over the repository: lint, including the banned-import rule that keeps
DeepSpeed's internals inside aidaptiv_ds/zero3/, and the formatter's check. CI fails here on either."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def ruff() -> list:
    """The ruff of this environment (requirements.txt pins it), else one on PATH."""
    here = pathlib.Path(sys.executable).with_name("ruff")
    if here.exists():
        return [str(here)]
    found = shutil.which("ruff")
    if not found:
        pytest.fail("ruff is not installed: run scripts/setup.sh (requirements.txt pins it)")
    return [found]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    out = run("check", "--output-format", "concise", ".")
    assert out.returncode == 0, "ruff check found problems (fix them, or ruff check --fix):\n" + out.stdout + out.stderr


def test_ruff_format_is_clean():
    out = run("format", "--check", ".")
    assert out.returncode == 0, "ruff format would change these files (run ruff format):\n" + out.stdout + out.stderr


def test_the_banned_import_rule_fires_outside_zero3(tmp_path):
    """The rule is configured for the package, not only present: a DeepSpeed internal imported in the harness
    is reported, the same import in zero3/ is not."""
    for rel in ("aidaptiv_ds/harness/probe.py", "aidaptiv_ds/zero3/probe.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("from deepspeed.runtime.zero import stage3\n\nprint(stage3)\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    out = subprocess.run(
        [*ruff(), "check", "--output-format", "concise", "--select", "TID251", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "aidaptiv_ds/harness/probe.py" in out.stdout and "TID251" in out.stdout, out.stdout + out.stderr
    assert "aidaptiv_ds/zero3/probe.py" not in out.stdout, out.stdout
