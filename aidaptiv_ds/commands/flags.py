"""The flags several commands share, each defined once: its spelling, the old spellings it still takes, the values
it reads and how they are parsed.

Every command adds a shared flag through :func:`add` and gets the same option strings, metavar and parser;
only its default and the sentence about what the flag does in that command are the command's own. The manual's
table of shared flags (docs/USAGE.md) is generated from :data:`SHARED` by ``scripts/flag_table.py``, and
``tests/unit/test_flags.py`` holds every command's parser to it.

Below the commands nothing names a flag: library errors name the parameter in backquotes (`` `host_budget` ``),
and :func:`as_flags` says it as the command's flag when the command prints the error.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

# Spellings kept for one release (CHANGELOG): old flag -> the flag that replaces it.
DEPRECATED: Dict[str, str] = {"--nvme": "--nvme-path", "--dir": "--nvme-path"}

DTYPES = ("fp32", "bf16", "fp16")
_DTYPE_LONG = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def parse_dtype(text: str) -> str:
    """fp32, bf16 or fp16 (torch's long names float32, bfloat16, float16 are taken too); "auto" passes through
    for the commands that offer it (argparse's choices then refuse it elsewhere)."""
    t = str(text).strip().lower()
    return _DTYPE_LONG.get(t, t)


def parse_host_budget(text: str) -> str:
    """A host memory budget in the ``"aidaptiv"`` block's grammar: a size ('512MiB', bytes), a share of RAM
    ('25%', of the node, split between its ranks), a size per node ('64GiB/node') or per rank ('16GiB/rank');
    "auto" passes through for commands that have an automatic default. Returns the text, checked."""
    t = str(text).strip()
    if t.lower() == "auto":
        return "auto"
    from aidaptiv_ds.common.sizes import check_unit
    from aidaptiv_ds.config.schema import parse_host_budget as grammar

    try:
        # Typed on a command line, a small bare number is a unit left out ('--host-budget 16'), refused as every
        # size flag refuses it; in the block a bare number stays bytes, as in the rest of a DeepSpeed config.
        check_unit(t, "--host-budget", per="/" + t.rpartition("/")[2] if "/" in t else "")
        grammar(t)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}") from None
    return t


def parse_gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB (e.g. 40)") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of GB")
    return value


def parse_seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} is outside 0..2**32-1 (what the random generators take)")
    return value


@dataclass(frozen=True)
class Flag:
    """One shared flag: what the manual's table and every command's parser say of it."""

    name: str  # "--host-budget"
    meaning: str  # what it is, in every command
    values: str  # what it reads
    parse: Optional[Callable] = None
    metavar: Optional[str] = None
    aliases: Tuple[str, ...] = ()  # old spellings, taken for one release
    choices: Optional[Tuple[str, ...]] = None
    extra: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


HOST_BUDGET = Flag(
    "--host-budget",
    "host memory for aidaptiv's staging buffers and RAM cache (train, plan) or for resident weights (generate)",
    "a size ('512MiB'; a bare number is bytes, at least 1048576), a share of RAM ('25%'), per node ('64GiB/node') "
    "or per rank ('16GiB/rank'); 'auto' where the command has an automatic default",
    parse_host_budget,
    "SIZE",
)
NVME_PATH = Flag(
    "--nvme-path",
    "the swap folder on the NVMe SSD",
    "an existing directory on a disk that takes O_DIRECT (not tmpfs or ramfs), writable; train's "
    "--create-nvme-path makes it",
    None,
    "DIR",
    aliases=(),
)
DTYPE = Flag(
    "--dtype",
    "the precision of weights and compute",
    "fp32, bf16 or fp16 (float32, bfloat16, float16 taken too); 'auto': the model's own precision (train: where "
    "this machine computes it natively; generate: as stored, or the config's dtype when the weight files mix "
    "dtypes, as transformers loads them)",
    parse_dtype,
    None,
    choices=DTYPES,
)
METRICS_OUT = Flag("--metrics-out", "where the command writes its figures as JSON", "a file path", None, "FILE.json")
SEED = Flag(
    "--seed", "the seed of every random choice the command makes", "a whole number, 0..2**32-1", parse_seed, "N"
)
GPU_MEM_CAP_GB = Flag(
    "--gpu-mem-cap-gb",
    "act as if the GPU had only this much memory (torch.cuda.set_per_process_memory_fraction)",
    "a positive number of GB",
    parse_gigabytes,
    "GB",
)

SHARED: Tuple[Flag, ...] = (HOST_BUDGET, NVME_PATH, DTYPE, METRICS_OUT, SEED, GPU_MEM_CAP_GB)


def add(group, flag: Flag, *, help: str, aliases: Tuple[str, ...] = (), auto: bool = False, **kwargs):
    """Add ``flag`` to a parser or argument group, as every command spells and parses it. ``aliases``: old
    spellings this command took (they must be in :data:`DEPRECATED`); ``auto``: "auto" is a value (the
    command's default chooses). Other keyword arguments (default, required, nargs) are the command's."""
    for a in aliases:
        if DEPRECATED.get(a) != flag.name:
            raise ValueError(f"{a} is not a deprecated spelling of {flag.name}")
    options = dict(kwargs)
    if flag.parse is not None:
        options["type"] = flag.parse
    if flag.metavar and "metavar" not in options:
        options["metavar"] = flag.metavar
    if flag.choices is not None:
        options["choices"] = (("auto",) if auto else ()) + flag.choices
    action = group.add_argument(flag.name, *aliases, dest=flag.dest, help=help, **options)
    action.shared_flag = flag
    action.deprecated_aliases = tuple(aliases)
    return action


def warn_deprecated(argv, prog: str) -> None:
    """One line on stderr for each old spelling on the command line (they are taken for one release)."""
    for a in argv:
        name = a.split("=", 1)[0]
        if name in DEPRECATED:
            print(
                f"{prog}: {name} is now {DEPRECATED[name]}; the old spelling goes in the next release", file=sys.stderr
            )


_BACKQUOTED = re.compile(r"`([a-z][a-z0-9_]*)`")


def as_flags(text: str, names=None) -> str:
    """A library error as a command says it: each backquoted parameter (`` `save_dir` ``) becomes its flag
    (``--save-dir``). ``names``: the parameters that are this command's flags (others stay as written)."""

    def flag(m):
        name = m.group(1)
        if names is not None and name not in names:
            return m.group(0)
        return "--" + name.replace("_", "-")

    return _BACKQUOTED.sub(flag, text)
