"""The engine under AddressSanitizer with UBSan, and under ThreadSanitizer: a sanitizer build of the
extension (tests/sanitize/build_engine.py, cached in build/sanitize/) put into a copy of the package, and test
tiers run against it in a child pytest whose interpreter has the sanitizer's runtime preloaded. A sanitizer
report fails the test with the report; so does a child whose engine is not the instrumented one.

- asan: ASan + UBSan (every UBSan finding is an error) over the io tier, the tests that drive the engine.
- tsan: ThreadSanitizer over the io tier's concurrency and GIL tests (the engine's threads, completions and the
  pinned pool under concurrent callers).

Leak detection is off: the interpreter and torch hold memory until exit by design.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(REPO, "build", "sanitize")

KINDS = {
    "asan": {
        "flags": "-fsanitize=address,undefined -fno-sanitize-recover=undefined",
        "runtime": ["libasan.so", "libubsan.so"],
        "env": {
            "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:detect_odr_violation=0",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        },
        "tests": ["tests/io"],
        # ASan's runtime replaces mlock() with a call that always succeeds, so a small RLIMIT_MEMLOCK cannot
        # make page-locking fail under it: that fallback is tested without the sanitizer.
        "deselect": ["tests/io/test_errors.py::test_small_memlock_limit_falls_back_to_plain_buffers"],
        "report": ("ERROR: AddressSanitizer", "runtime error:"),
    },
    "tsan": {
        "flags": "-fsanitize=thread",
        "runtime": ["libtsan.so"],
        "env": {"TSAN_OPTIONS": "halt_on_error=1:report_signal_unsafe=0:second_deadlock_stack=1"},
        # Not our code: glibc's dynamic TLS as threads of the uninstrumented OpenMP runtime (torch's intra-op
        # pool) start and end. Without these, every run reports that race before the engine is even used.
        "suppressions": ["race:_dl_deallocate_tls", "race:allocate_dtv_entry", "called_from_lib:libgomp.so.1"],
        "tests": ["tests/io/test_concurrency.py", "tests/io/test_gil.py"],
        "report": ("WARNING: ThreadSanitizer", "ERROR: ThreadSanitizer"),
    },
}


def runtime_paths(names):
    out = []
    for name in names:
        path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            pytest.skip(f"the sanitizer runtime {name} is not installed (gcc's libasan/libtsan packages)")
        out.append(os.path.realpath(path))
    return out


def overlay(tmp_path, engine: str) -> str:
    """A copy of what the tiers need (the package, the tests, the configs) with the instrumented engine in
    place of the regular one."""
    root = tmp_path / "checkout"
    for name in ("aidaptiv_ds", "tests", "ds_configs", "examples", "bench"):
        shutil.copytree(
            os.path.join(REPO, name), root / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "results")
        )
    for name in ("pytest.ini", "pyproject.toml"):
        shutil.copy(os.path.join(REPO, name), root / name)
    shutil.copy(engine, root / "aidaptiv_ds" / "engine" / "_C.so")
    return str(root)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_engine_is_clean_under(kind, tmp_path):
    spec = KINDS[kind]
    preload = ":".join(runtime_paths(spec["runtime"]))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.update(spec["env"], LD_PRELOAD=preload, AIDAPTIV_DS_AUTOLOAD="0")
    # Reports to files: pytest captures a test's stderr, and a runtime that halts on the first report takes
    # the captured text with it.
    logs = tmp_path / "reports"
    logs.mkdir()
    for key in spec["env"]:
        env[key] += f":log_path={logs / kind}"
    if spec.get("suppressions"):
        supp = tmp_path / "suppressions.txt"
        supp.write_text("\n".join(spec["suppressions"]) + "\n")
        env["TSAN_OPTIONS"] += f":suppressions={supp}"
    build = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tests", "sanitize", "build_engine.py"),
            REPO,
            os.path.join(CACHE, kind),
            spec["flags"],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    engine = build.stdout.strip().splitlines()[-1]
    root = overlay(tmp_path, engine)
    env["PYTHONPATH"] = root
    probe = subprocess.run(
        [sys.executable, "-P", "-c", "import torch; from aidaptiv_ds.engine import _C; print(_C.__file__)"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0 and probe.stdout.strip().endswith(os.path.join("engine", "_C.so")), (
        probe.stdout + probe.stderr[-3000:]
    )
    run = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "pytest",
            *spec["tests"],
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            *[arg for test in spec.get("deselect", []) for arg in ("--deselect", test)],
        ],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    output = run.stdout + run.stderr
    written = "".join(p.read_text(errors="replace") for p in sorted(logs.iterdir()))
    reports = [line for line in (output + written).splitlines() if any(marker in line for marker in spec["report"])]
    assert not reports, f"{kind} found:\n" + written[:8000] + "\n" + output[-3000:]
    assert run.returncode == 0, output[-6000:] + written[:3000]
