"""Build the engine (csrc/) with sanitizer flags into a folder, as a child process that has the sanitizer's
runtime preloaded (torch's extension loader imports what it built, and an instrumented library loads only into
a process whose runtime came first).

    LD_PRELOAD=... python tests/sanitize/build_engine.py REPO OUT_DIR "-fsanitize=... flags"

Prints the path of the built module. The same sources, include folders and liburing archive as setup.py,
without the CUDA copy path (CPU build)."""

from __future__ import annotations

import glob
import os
import sys
import sysconfig


def liburing() -> tuple[str, str]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    for root in ("/usr", "/usr/local"):
        for libdir in ("lib", os.path.join("lib", multiarch), "lib64"):
            archive = os.path.join(root, libdir, "liburing.a")
            if os.path.exists(archive) and os.path.exists(os.path.join(root, "include", "liburing.h")):
                return os.path.join(root, "include"), archive
    raise SystemExit("liburing-dev is not installed (scripts/setup.sh installs it)")


def main() -> None:
    repo, out, flags = sys.argv[1], sys.argv[2], sys.argv[3].split()
    # This process has the runtime preloaded (to import what it builds); the compilers it starts must not:
    # g++ under a preloaded ThreadSanitizer runtime crashes.
    os.environ.pop("LD_PRELOAD", None)
    from torch.utils import cpp_extension

    include, archive = liburing()
    sources = sorted(glob.glob(os.path.join(repo, "csrc", "src", "*.cpp"))) + [
        os.path.join(repo, "csrc", "bindings.cpp")
    ]
    os.makedirs(out, exist_ok=True)
    module = cpp_extension.load(
        name="_C",
        sources=sources,
        extra_include_paths=[os.path.join(repo, "csrc", "include"), include],
        extra_cflags=["-O1", "-g", "-fno-omit-frame-pointer", "-std=c++20", *flags],
        extra_ldflags=[*flags, archive],
        build_directory=out,
        verbose=False,
    )
    print(module.__file__)


if __name__ == "__main__":
    main()
