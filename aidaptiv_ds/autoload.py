"""Let unmodified programs pick up the ``"aidaptiv"`` block: the start-up hook.

Installing aidaptiv-ds puts ``aidaptiv_ds_autoload.pth`` in site-packages; Python runs it at start-up and it
imports this module, which only registers an import hook (no torch, no DeepSpeed). When a program later
imports ``deepspeed``, the hook hands the freshly run module to
:func:`aidaptiv_ds.zero3.entry_points.patch_deepspeed`, which wraps ``deepspeed.initialize`` and
``deepspeed.zero.Init`` so that a config with an enabled ``"aidaptiv"`` block goes through our swapper and any
other config reaches DeepSpeed untouched.

So a plain ``deepspeed.initialize`` script, or HF Trainer with ``--deepspeed config.json``, started by the
``deepspeed`` launcher as usual, runs with our swapper when the config says so, and exactly as before when
it does not. Set ``AIDAPTIV_DS_AUTOLOAD=0`` to switch the hook off: the .pth line reads it first and then
leaves the package unimported (:func:`install_hook` checks it too, for a program that imports this module itself).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV = "AIDAPTIV_DS_AUTOLOAD"


def _patch(deepspeed) -> None:
    from aidaptiv_ds.zero3.entry_points import patch_deepspeed

    patch_deepspeed(deepspeed)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            _patch(module)
        except Exception as e:  # never break `import deepspeed` because of us
            print(
                f'aidaptiv-ds: could not hook deepspeed ({e}); the "aidaptiv" block is ignored unless '
                "aidaptiv_ds.initialize is called",
                file=sys.stderr,
            )


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Waits for ``import deepspeed`` and patches the module right after it has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def install_hook() -> None:
    if os.environ.get(ENV, "1") == "0":
        return
    if "deepspeed" in sys.modules:
        try:
            _patch(sys.modules["deepspeed"])
        except Exception:
            pass
        return
    if not any(isinstance(f, _DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedFinder())


install_hook()
