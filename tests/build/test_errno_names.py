"""error.cpp builds and names errnos on a C library without strerrorname_np (glibc < 2.32).

The engine's error sentences start with the errno's name ("ENOSPC (No space left on device)"), which glibc
2.32 and later give through strerrorname_np. On an older glibc that function does not exist, so error.cpp
falls back to a table. This machine's glibc is newer, so the test makes the old one: error.cpp is compiled
with AIDAPTIV_NO_STRERRORNAME_NP (the fallback branch) and with strerrorname_np renamed to a symbol that no
library defines, so a build that still calls it fails to link, as it would on glibc 2.31. The program is
then run and its names compared with this glibc's own strerrorname_np. Needs only a C++ compiler."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"

MAIN = r"""
#include <cstdio>
#include <cstdlib>
#include "aidaptiv/error.hpp"
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) std::printf("%s\n", aidaptiv::errno_text(std::atoi(argv[i])).c_str());
  return 0;
}
"""

CODES = list(range(1, 134)) + [9999]


def compiler():
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def glibc_name(code: int):
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "strerrorname_np"):
        return None
    libc.strerrorname_np.restype = ctypes.c_char_p
    name = libc.strerrorname_np(code)
    return name.decode() if name else None


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler")
def test_error_cpp_builds_and_names_errnos_without_strerrorname_np(tmp_path):
    main = tmp_path / "main.cpp"
    main.write_text(MAIN)
    exe = tmp_path / "errno_names"
    cmd = [
        compiler(),
        "-std=c++20",
        "-O0",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-I{CSRC / 'include'}",
        "-DAIDAPTIV_NO_STRERRORNAME_NP",
        "-Dstrerrorname_np=strerrorname_np_needs_glibc_2_32",
        str(CSRC / "src" / "error.cpp"),
        str(main),
        "-o",
        str(exe),
    ]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"error.cpp does not build without strerrorname_np:\n{build.stderr[-3000:]}"
    run = subprocess.run([str(exe)] + [str(c) for c in CODES], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == len(CODES)
    texts = dict(zip(CODES, lines))
    # The codes the engine's errors name, by name, with the C library's text.
    for name in (
        "ENOENT",
        "EACCES",
        "EIO",
        "EINVAL",
        "ENOSPC",
        "EFBIG",
        "EDQUOT",
        "ENOMEM",
        "EAGAIN",
        "EBADF",
        "ENODATA",
        "ELOOP",
        "EPERM",
        "ENOSYS",
        "EROFS",
        "EMFILE",
        "EOPNOTSUPP",
        "ECANCELED",
    ):
        code = getattr(errno, name)
        assert texts[code] == f"{name} ({os.strerror(code)})", texts[code]
    # Every other code is either named as this glibc names it, or given by number; never a wrong name.
    for code, text in texts.items():
        name = text.split(" (", 1)[0]
        if name.startswith("errno "):
            assert name == f"errno {code}"
        else:
            expected = glibc_name(code)
            assert expected is None or name == expected, (code, name, expected)
    assert texts[9999].startswith("errno 9999 (")
