"""Build DeepSpeed's just-in-time ops by their builder names, one line per op saying how it went.

    python -m aidaptiv_ds.zero3.op_builds CPUAdamBuilder AsyncIOBuilder ...

Run as its own process (as :mod:`aidaptiv_ds.harness.prebuild` does): a compile needs memory and time that
should count against no one's run. The builder names are DeepSpeed's class names; the accelerator picks
its own builder for each (CPU or CUDA), and some names mean nothing to some accelerators.
"""

from __future__ import annotations

import sys


def build_ops(names) -> list[str]:
    """``"<name>: ready"``, ``"...: not used by this accelerator"``, ``"...: not compatible here ..."`` or
    ``"...: build failed: <last line>"`` for each name; never raises for a failed build."""
    from deepspeed.accelerator import get_accelerator

    lines = []
    for name in names:
        builder = get_accelerator().get_op_builder(name)
        if builder is None:
            lines.append(f"{name}: not used by this accelerator")
            continue
        if not builder().is_compatible():
            lines.append(f"{name}: not compatible here (the cells that need it will say why)")
            continue
        try:
            builder().load(verbose=False)
            lines.append(f"{name}: ready")
        except Exception as e:
            lines.append(f"{name}: build failed: {str(e).splitlines()[-1] if str(e) else type(e).__name__}")
    return lines


if __name__ == "__main__":
    for line in build_ops(sys.argv[1:]):
        print(line, flush=True)
