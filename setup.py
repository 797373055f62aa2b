"""Build of aidaptiv-ds and its C++ engine, aidaptiv_ds.engine._C.

Build with the torch already installed (``pip install --no-build-isolation .``): the engine is a torch
extension and must match that torch's ABI. liburing is linked statically from the distribution's
liburing-dev (2.3) or from ``LIBURING_PREFIX`` (a folder with include/liburing.h and lib/liburing.a).
The CUDA copy path is compiled only when the installed torch has CUDA.
"""

import glob
import os
import sysconfig

import torch
from setuptools import setup
from setuptools.command.build_py import build_py
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def find_liburing():
    """Return (include_dir, static_library) for liburing, or stop the build with what to install."""
    prefix = os.environ.get("LIBURING_PREFIX")
    prefixes = [prefix] if prefix else ["/usr", "/usr/local"]
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    for root in prefixes:
        include = os.path.join(root, "include")
        if not os.path.exists(os.path.join(include, "liburing.h")):
            continue
        for libdir in ("lib", os.path.join("lib", multiarch), "lib64"):
            archive = os.path.join(root, libdir, "liburing.a")
            if os.path.exists(archive):
                return include, archive
    where = f"LIBURING_PREFIX={prefix}" if prefix else "/usr and /usr/local"
    raise SystemExit(
        f"liburing was not found in {where} (need include/liburing.h and lib/liburing.a): install the "
        "distribution package (apt-get install liburing-dev) or set LIBURING_PREFIX to a folder that has them"
    )


class BuildPyWithAutoload(build_py):
    """Also ship aidaptiv_ds_autoload.pth at the top of site-packages: Python runs it at start-up and it
    hooks ``deepspeed.initialize``/``zero.Init`` so that unmodified programs honour the "aidaptiv" block
    (see aidaptiv_ds/autoload.py). scripts/setup.sh copies it for editable installs."""

    def run(self):
        super().run()
        self.copy_file(
            os.path.join(HERE, "aidaptiv_ds_autoload.pth"), os.path.join(self.build_lib, "aidaptiv_ds_autoload.pth")
        )


def engine_extension():
    uring_include, uring_archive = find_liburing()
    sources = sorted(glob.glob("csrc/src/*.cpp")) + ["csrc/bindings.cpp"]
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    define_macros = [("AIDAPTIV_WITH_CUDA", "1")] if with_cuda else []
    if with_cuda:
        sources += sorted(glob.glob("csrc/src/cuda/*.cpp"))
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    return kind(
        name="aidaptiv_ds.engine._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc", "include"), uring_include],
        define_macros=define_macros,
        extra_compile_args={"cxx": ["-O3", "-std=c++20", "-Wall", "-Wextra", "-Wno-unused-parameter"]},
        extra_objects=[uring_archive],
    )


# Metadata, the version (aidaptiv_ds.__version__), the packages, their data and the console script are in
# pyproject.toml; setup.py stays for what pyproject.toml cannot declare: the engine extension and the hook file.
setup(
    ext_modules=[engine_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension, "build_py": BuildPyWithAutoload},
)
