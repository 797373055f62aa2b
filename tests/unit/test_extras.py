"""The package's extras (pyproject.toml): a training node installs the core only, so no module imports an extra's
package at import time, the few that use one import it where used, and a missing one is named with its extra."""

import ast
import os
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from helpers import REPO

from aidaptiv_ds.common import extras

PACKAGE = Path(REPO) / "aidaptiv_ds"
# Where each optional package may be imported (inside a function, never at module level).
USERS = {
    "gradio": {"studio/app.py", "studio/server.py"},  # server.py also imports fastapi and uvicorn, which gradio brings
    "pandas": {"studio/views.py"},  # the plan's table
    "pypdf": {"studio/documents.py"},
    "docx": {"studio/documents.py"},
    "bitsandbytes": {"job/lora.py"},
    "wandb": {"zero3/monitors.py"},
    "tensorboard": set(),  # DeepSpeed's monitor imports it; job/train.py only checks that it is there
    "matplotlib": {"harness/report_figures.py", "harness/run_report.py"},
    "gguf": {"models/gguf.py", "models/gguf_writer.py"},  # reading (with transformers' reader) and writing
}


def _imports(tree):
    """(module's top-level name, at module level?) of every import in ``tree``."""
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield name.split(".")[0], id(node) in top


def test_optional_packages_are_imported_only_where_used_and_never_at_module_level():
    assert set(USERS) == set(extras.OPTIONAL)
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for name, at_module_level in _imports(ast.parse(path.read_text())):
            if name in USERS and (at_module_level or rel not in USERS[name]):
                wrong.append(f"{rel} imports {name}" + (" at module level" if at_module_level else ""))
    assert not wrong, wrong


def _requirement_name(spec: str) -> str:
    return re.split(r"[<>=!\[ ;]", spec, maxsplit=1)[0].lower()


def test_pyproject_declares_each_optional_package_in_its_extra_and_requirements_pins_the_extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    project = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]
    core = {_requirement_name(d) for d in project["dependencies"]}
    declared = project["optional-dependencies"]
    for module, (dist, extra) in extras.OPTIONAL.items():
        assert dist not in core, f"{dist} is optional ({extra}) but a core dependency"
        if module != "pandas":  # gradio's own dependency
            assert dist in {_requirement_name(d) for d in declared[extra]}, (dist, extra)
    dev = {_requirement_name(d) for d in declared["dev"]}
    assert {"pytest", "ruff", "playwright"} <= dev
    assert "aidaptiv-ds[studio,qlora,tracking,report,gguf]" in declared["dev"]  # the tests need every extra
    pinned = {
        line.split("==")[0].strip().lower()
        for line in (Path(REPO) / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    }
    optional = {_requirement_name(d) for ds in declared.values() for d in ds} - {"aidaptiv-ds"}
    assert optional <= pinned, optional - pinned  # scripts/setup.sh installs every extra: the tests need them


def test_the_message_names_the_extra():
    assert extras.install_command("gradio", "docx") == "pip install 'aidaptiv-ds[studio]'"
    assert extras.missing_message("the studio", ["gradio"]) == (
        "the studio needs gradio, which is not installed: pip install 'aidaptiv-ds[studio]'"
    )
    assert extras.install_command("wandb", "matplotlib") == "pip install 'aidaptiv-ds[report,tracking]'"


def test_the_studio_command_without_its_packages_says_which_extra(monkeypatch, tmp_path, capsys):
    from aidaptiv_ds.commands import studio

    monkeypatch.setitem(sys.modules, "gradio", None)  # find_spec then answers None, import fails
    args = Namespace(host="127.0.0.1", port=0, root=str(tmp_path), password_file=None, max_upload="1MB")
    assert studio.run(args) == 1
    assert "needs gradio, which is not installed: pip install 'aidaptiv-ds[studio]'" in capsys.readouterr().err


def test_qlora_without_bitsandbytes_says_which_extra(monkeypatch):
    torch = pytest.importorskip("torch")
    from aidaptiv_ds.job.lora import quantize_base

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(
        ValueError, match=r"needs bitsandbytes, which is not installed: pip install 'aidaptiv-ds\[qlora\]'"
    ):
        quantize_base(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.float32)


def test_every_module_imports_without_the_extras(tmp_path):
    """In a fresh interpreter where no extra's package can be imported, every module of the package imports."""
    script = tmp_path / "no_extras.py"
    script.write_text(
        "import pkgutil, sys\n"
        f"for name in {sorted(extras.OPTIONAL)!r}:\n"
        "    sys.modules[name] = None  # import fails, find_spec answers None\n"
        "import aidaptiv_ds\n"
        "names = [m.name for m in pkgutil.walk_packages(aidaptiv_ds.__path__, 'aidaptiv_ds.')]\n"
        "for name in names:\n"
        "    if name.endswith('.__main__') or name.endswith('engine._C'):\n"
        "        continue\n"
        "    __import__(name)\n"
        "print(len(names))\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 50
