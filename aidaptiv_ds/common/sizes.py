"""Byte sizes: the one parser of size strings, the unit constants, O_DIRECT alignment, element sizes and
the bytes of training state per parameter.

One meaning everywhere (the README's): decimal units are powers of 1000 ("4GB" is 4,000,000,000 bytes),
binary units powers of 1024 ("4GiB" is 4 x 2^30); a bare "k", "M", "G" or "T" is binary, as in ``dd``
and ``fio`` ("1M" is 1,048,576). This module imports nothing of ours and no torch at import time, so every
layer (config, engine, harness, planner) may use it.
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

# O_DIRECT needs offsets, lengths and buffer addresses in multiples of the logical block size; 4 KiB is a
# multiple of every block size in use (512 B and 4 KiB sectors), so the engine, the swap store and every
# layout aligns to it.
ALIGN = 4096

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "ki": KiB,
    "kib": KiB,
    "kb": 10**3,
    "m": MiB,
    "mi": MiB,
    "mib": MiB,
    "mb": 10**6,
    "g": GiB,
    "gi": GiB,
    "gib": GiB,
    "gb": 10**9,
    "t": TiB,
    "ti": TiB,
    "tib": TiB,
    "tb": 10**12,
}


def parse_size(value, what: str = "size") -> int:
    """Bytes from an int or a size string: "268435456", "256MiB", "4GB" (decimal), "4GiB", "1M" (binary).

    Raises ValueError naming ``what`` (the setting or variable) and the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size in bytes, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: a size cannot be negative, got {value}")
        return value
    text = str(value)
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(
            f"{what}={text!r} is not a size: use bytes (268435456) or a number with a unit: "
            "KiB/MiB/GiB/TiB (powers of 1024; also k/M/G/T), KB/MB/GB/TB (powers of 1000)"
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


# A number typed without a unit is bytes, as in a DeepSpeed config; on a command line one below this is a unit
# left out ("--gpu-mem 40" for 40 GB), never a size meant: no memory, disk or bandwidth a flag describes is under
# a mebibyte, and bytes typed out for one run to seven digits or more.
MIN_BARE_BYTES = MiB


def check_unit(text: str, what: str, per: str = "") -> None:
    """Refuse a size typed without a unit that is above 0 and below :data:`MIN_BARE_BYTES`: ValueError naming
    ``what`` and saying what to write. ``per``: what the size is per ("/s" for a bandwidth, "/node"), left off
    ``text`` if it ends with it. 0, sizes with a unit and what is not a size at all pass."""
    t = str(text).strip()
    number = t[: -len(per)].strip() if per and t.endswith(per) else t
    m = _SIZE_RE.match(number)
    if m and not m.group(2) and 0 < float(m.group(1)) < MIN_BARE_BYTES:
        raise ValueError(
            f"{what} {t} has no unit, so it means {number} bytes{per}: write {number}GB{per} (or "
            f"{number}GiB{per}), or bytes of at least {MIN_BARE_BYTES}"
        )


def parse_size_arg(text: str, what: str) -> int:
    """A size as a command-line flag takes it: :func:`parse_size`, with a number typed without a unit below
    :data:`MIN_BARE_BYTES` refused (:func:`check_unit`)."""
    check_unit(text, what)
    return parse_size(text, what)


def format_size(n: float) -> str:
    """Bytes for a person: "512.0 MiB", "2.05 GiB" (powers of 1024, the units parse_size reads back)."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / KiB:.1f} KiB" if n >= KiB else f"{int(n)} B"


# aidaptiv's swap files (params.swp, optim.swp, activations.swp) grow in steps of this size (posix_fallocate;
# swap/space.py), so each holds up to one step more on disk than its extents use; the planner counts it.
SWAP_FILE_GROW_STEP = 256 * MiB


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype (or of the names "fp32", "bf16", "fp16")."""
    if isinstance(dtype, str):
        return {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}[dtype]
    return dtype.itemsize


def swap_bytes_per_param(param_bytes: int = 4) -> int:
    """Bytes aidaptiv's swap space holds per trained parameter: the parameter, its fp32 gradient (spilled for the
    deferred update), two fp32 moments, and an fp32 master copy unless the parameter is fp32 (then it is its
    own master: 16 in fp32, 18 in bf16). The planner's NVMe items (planner/memory.py) add up to the same."""
    return param_bytes + 4 + 4 + 4 + (0 if param_bytes == 4 else 4)


def state_bytes_per_param(param_bytes: int = 4) -> int:
    """Bytes of training state one parameter carries under ZeRO-3 with Adam: the parameter itself
    (``param_bytes``: 4 in fp32, 2 in bf16), an fp32 gradient, an fp32 master copy and two fp32 moments.
    What the swap space holds per parameter, and what a sweep sizes host budgets against (20 in fp32)."""
    return param_bytes + 4 + 4 + 4 + 4
