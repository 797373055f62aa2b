"""What the files of a save folder may do: every pickle DeepSpeed wrote in a tag is unpickled as data only before
the tag resumes (:func:`check_pickles_are_data`, with :func:`refused_file`'s sentence for one that is not), and
DeepSpeed's recovery scripts in the folder are replaced by one that says which command converts it
(:func:`write_recovery_pointers`). The checksums (:mod:`aidaptiv_ds.swap.checkpoint_verify`) find damage, not
tampering: a file changed with its checksum rewritten is caught here, by what it holds."""

from __future__ import annotations

import os

from aidaptiv_ds.swap.checkpoint_format import CheckpointDamagedError
from aidaptiv_ds.swap.checkpoint_verify import AGAIN, tag_files
from aidaptiv_ds.zero3 import compat


def refused_file(path: str, error: BaseException) -> CheckpointDamagedError:
    """The error for a checkpoint file ``torch.load(weights_only=True)`` would not load, saying why and what to do."""
    import pickle
    import re

    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if isinstance(error, pickle.UnpicklingError):
        # torch names the refused global in a paragraph of advice ("Unsupported global: GLOBAL builtins.exec was
        # not an allowed global by default. Please use ..."): only the name goes into our sentence.
        named = re.search(r"GLOBAL ([\w.]+)", str(error))
        what = f"a reference to {named.group(1)}" if named else "an object the data-only load refuses"
        return CheckpointDamagedError(
            f"checkpoint file {path} holds objects other than tensors and plain data ({what}), which could run code "
            "when loaded, so it is refused; neither aidaptiv-ds nor DeepSpeed writes such objects there, so the file "
            "was changed after its save (or a client_state given to save_checkpoint held one: keep it plain data); "
            f"{AGAIN}"
        )
    return CheckpointDamagedError(
        f"checkpoint file {path} cannot be read ({type(error).__name__}: {first}): it is truncated or damaged; {AGAIN}"
    )


def check_pickles_are_data(tag_dir: str) -> None:
    """Unpickle, as data only, every ``.pt`` file of a tag outside aidaptiv/ and hf/ (DeepSpeed's model and
    optimizer states of every rank), raising :func:`refused_file`'s error for the first that holds anything else.

    DeepSpeed 0.19.8 does not read every file a save wrote: with the optimizer on NVMe (every aidaptiv run) it
    never loads ``*_optim_states.pt``, and a tool run later on the folder (its zero_to_fp32.py, a user's
    ``torch.load``) would unpickle what nobody checked. A tag that resumes is one whose every pickle is data.
    The tensors' bytes are mapped, not read (``mmap``): memory stays at the pickles' own objects."""
    for rel in tag_files(tag_dir):
        if not rel.endswith(".pt"):
            continue
        path = os.path.join(tag_dir, rel)
        try:
            compat.load_as_data(path, map_location="cpu", mmap=True)
        except Exception as e:  # UnpicklingError, a truncated zip (RuntimeError), OSError: all say "refused"
            raise refused_file(path, e) from None


# What DeepSpeed's recovery scripts become in the save dir of an aidaptiv run. They are replaced, not removed:
# a user who follows DeepSpeed's habit (``python zero_to_fp32.py . out``, or importing it) learns the command
# that converts this folder instead of finding nothing, and the replacement reads no file, so no planted pickle
# can run through it. DeepSpeed's own scripts cannot work here: they rebuild the weights from the fp32 groups of
# *_optim_states.pt, which hold nothing when the optimizer state lives on NVMe (ours is in aidaptiv/rank<r>/).
RECOVERY_POINTER = '''#!/usr/bin/env python3
"""Written by aidaptiv-ds in place of DeepSpeed's {script}, which cannot convert this folder: an aidaptiv run
keeps its weights in <tag>/aidaptiv/rank<r>/params.bin. This script reads no file."""

import sys

MESSAGE = (
    "{script}: this folder holds checkpoints of an aidaptiv-ds run, whose weights DeepSpeed's {script} cannot "
    "read: run `aidaptiv-ds export <this folder, or one of its tags> --out DIR` for a Hugging Face model folder"
)


def __getattr__(name):  # `from {module} import ...` ends here, with the message
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(MESSAGE)


if __name__ == "__main__":
    sys.exit(MESSAGE)
'''


def write_recovery_pointers(save_dir: str) -> None:
    """Write :data:`RECOVERY_POINTER` under each of DeepSpeed's recovery script names in ``save_dir``, replacing
    DeepSpeed's copies (an earlier save's) atomically, with the mode DeepSpeed gives them (executable)."""
    for script in compat.RECOVERY_SCRIPTS:
        path = os.path.join(save_dir, script)
        tmp = f"{path}.{os.getpid()}.partial"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(RECOVERY_POINTER.format(script=script, module=script[: -len(".py")]))
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
