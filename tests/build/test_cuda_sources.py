"""The engine's CUDA side compiles, on a machine without a GPU.

setup.py builds the CUDA copy path (csrc/src/cuda/, and the AIDAPTIV_WITH_CUDA parts of engine.hpp and
bindings.cpp) only when torch has CUDA, which the development and CI machines never have: without this test
a CUDA build break would show only when a GPU machine is lent. These machines do have CUDA's headers (the
toolkit that ships nvcc), and torch's CPU wheel ships the c10/cuda headers except the generated
c10/cuda/impl/cuda_cmake_macros.h, for which an empty stand-in is enough to compile. Every source that the
define changes is compiled to object code with the flags setup.py gives the C++ compiler; nothing is linked
or run. Skipped where no CUDA toolkit is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"


def cuda_home():
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if candidate and (Path(candidate) / "include" / "cuda_runtime_api.h").exists():
            return Path(candidate)
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parents[1]
        if (root / "include" / "cuda_runtime_api.h").exists():
            return root
    default = Path("/usr/local/cuda")
    return default if (default / "include" / "cuda_runtime_api.h").exists() else None


def cuda_dependent_sources():
    """Sources whose compiled code changes with AIDAPTIV_WITH_CUDA: those that test it, or include a
    header of ours that does."""
    headers = {p.name for p in (CSRC / "include").rglob("*.hpp") if "AIDAPTIV_WITH_CUDA" in p.read_text()}
    out = []
    for src in sorted(CSRC.rglob("*.cpp")):
        text = src.read_text()
        included = set(re.findall(r'#include\s+"aidaptiv/(?:detail/)?([\w.]+)"', text))
        if "AIDAPTIV_WITH_CUDA" in text or included & headers:
            out.append(src)
    return out


def test_the_cuda_sources_are_found():
    names = {p.relative_to(CSRC).as_posix() for p in cuda_dependent_sources()}
    # The copy pipeline, the CUDA page-locking, and the two files that declare and bind them.
    assert {"src/cuda/device_copy.cpp", "src/cuda/host_register.cpp", "bindings.cpp", "src/engine.cpp"} <= names


@pytest.mark.skipif(cuda_home() is None, reason="no CUDA toolkit (cuda_runtime_api.h) on this machine")
def test_cuda_sources_compile_with_aidaptiv_with_cuda(tmp_path):
    import torch
    from torch.utils import cpp_extension

    stand_in = tmp_path / "include" / "c10" / "cuda" / "impl"
    stand_in.mkdir(parents=True)
    (stand_in / "cuda_cmake_macros.h").write_text(
        "#pragma once\n// stand-in for the header CUDA builds of torch generate\n"
    )
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    flags = [
        "-c",
        "-fPIC",
        "-O0",
        "-std=c++20",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        "-DAIDAPTIV_WITH_CUDA=1",
        "-DTORCH_EXTENSION_NAME=_C",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{CSRC / 'include'}",
        f"-I{tmp_path / 'include'}",
        *[f"-I{p}" for p in cpp_extension.include_paths()],
        f"-I{cuda_home() / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    compiler = os.environ.get("CXX", "c++")

    def compile_one(src: Path):
        obj = tmp_path / (src.stem + ".o")
        done = subprocess.run([compiler, *flags, str(src), "-o", str(obj)], capture_output=True, text=True)
        return src, obj, done

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(compile_one, cuda_dependent_sources()))
    failures = [f"{src.relative_to(REPO)}:\n{done.stderr[-3000:]}" for src, _, done in results if done.returncode]
    assert not failures, "CUDA build of the engine is broken:\n" + "\n".join(failures)
    for src, obj, _ in results:
        assert obj.stat().st_size > 0, f"{src} produced an empty object file"
    # The pipeline really was compiled in, not skipped by the preprocessor.
    symbols = subprocess.run(["nm", "-C", str(tmp_path / "device_copy.o")], capture_output=True, text=True).stdout
    assert "read_to_device" in symbols and "write_from_device" in symbols, symbols[:2000]
