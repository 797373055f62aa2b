"""The checkpoint format of the swapped state: where a tag's files are, what a rank's manifest holds, and
reading it back. Nothing here needs DeepSpeed or torch, and it imports nothing of ours.

An aidaptiv run saves, next to DeepSpeed's files, a folder per rank with every byte a resumed run needs::

    <save_dir>/<tag>/aidaptiv/rank<r>/
        params.bin     this rank's partition of every parameter (model dtype), in the swap file's layout
        base.bin       with a frozen base (LoRA, QLoRA): the frozen parameters' partitions, at their offsets in the
                       same layout (params.bin then holds the trained ones only; both files are sparse), the
                       same file (a hard link) in every checkpoint of one run
        optim.bin      the optimizer chunk images: fp32 master (unless the parameter is the master) and the
                       optimizer's state tensors, in the optimizer swap file's layout
        manifest.json  FORMAT 2: for every parameter (by the name ``module.named_parameters()`` gives it in
                       the model DeepSpeed wraps) its shape, partition size, file and offset; for
                       every sub-group its chunks as pieces of named parameters, its state keys and scalars
                       (Adam's step count); the optimizer's hyperparameters; the sizes of both files
    <save_dir>/<tag>/hf/    config.json and tokenizer files the train job saves with a tag (MODEL_FILES)
    <save_dir>/latest       the name of the newest tag (DeepSpeed's file)

ZeRO-3 cuts each parameter, flattened and padded to a multiple of the world size, into equal slices, rank r
holding elements ``[r * partition_numel, (r + 1) * partition_numel)``; a parameter is the ranks' slices in
rank order, cut to its size.

Its users: :mod:`aidaptiv_ds.zero3.checkpoint` writes and loads a rank's folder (which needs the running
engine), :mod:`aidaptiv_ds.swap.checkpoint_verify` checks its bytes, :mod:`aidaptiv_ds.job.export` writes its
model as a Hugging Face folder and :mod:`aidaptiv_ds.inference.sources` generates from it. What they share is
here: the names and paths, the refusals (:class:`CheckpointMismatchError`, :class:`CheckpointDamagedError`),
one rank's manifest checked before a load (:func:`read_manifest`), every rank's manifest of a tag checked to
describe one model (:class:`Checkpoint`), and a parameter's bytes read from the ranks' files
(:func:`read_pieces`).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

FORMAT = 2
STATE_DIR = "aidaptiv"  # <tag>/aidaptiv/: the swapped state, a folder per rank
MANIFEST = "manifest.json"
PARAMS = "params.bin"
# A run with a frozen base (LoRA, QLoRA) keeps the base's partitions apart from the trained ones: hard-linked from
# one checkpoint to the next of the same run, since a frozen weight never changes (see zero3/checkpoint.py).
BASE = "base.bin"
OPTIM = "optim.bin"
MODEL_FILES = "hf"  # <save_dir>/<tag>/hf/: config.json and tokenizer files the train job saves with a tag
LATEST = "latest"  # <save_dir>/latest: the newest tag's name

# Bytes per element of the model dtypes a checkpoint's weights are read in, by the names the manifest uses
# (torch's, without "torch.").
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class CheckpointMismatchError(ValueError):
    """A checkpoint this run cannot load: another model, dtype or world size, or a format this version does not
    read."""


class CheckpointDamagedError(CheckpointMismatchError):
    """A checkpoint file that is not what its save wrote: changed, truncated, planted or holding NaN/inf. Every
    rank raises it together (see aidaptiv_ds.zero3.engine_hooks), so --resume auto skips the tag on all."""


def rank_dir(root: str, tag: str, rank: int) -> str:
    return os.path.join(root, str(tag), STATE_DIR, f"rank{rank}")


def resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag a load reads: ``tag``, or the one ``latest`` names (None when there is no ``latest``)."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as f:
        return f.read().strip()


def read_manifest(load_dir: str, tag: str, rank: int, world_size: int) -> tuple:
    """(folder, manifest) of ``rank``'s state in a checkpoint, refusing what this version cannot load into a run
    of ``world_size`` ranks."""
    folder = rank_dir(load_dir, tag, rank)
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise CheckpointMismatchError(
            f"checkpoint {os.path.join(load_dir, tag)} does not exist: give the tag of a completed save (the one "
            f"'{LATEST}' in {load_dir} names, or one of its folders)"
        )
    if not os.path.exists(path):
        raise CheckpointMismatchError(
            f"checkpoint {os.path.join(load_dir, tag)} has no aidaptiv state for rank {rank} ({path} is "
            "missing): it was not saved by an aidaptiv run with this many ranks; resume it with the config "
            "and world size that saved it"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        fmt = manifest.get("format")
    except (ValueError, AttributeError) as e:  # not JSON, or not an object
        raise CheckpointDamagedError(
            f"checkpoint manifest {path} cannot be read ({e}): the checkpoint is damaged; resume from another one"
        ) from None
    if fmt != FORMAT:
        old = (
            " (keyed by DeepSpeed's process-wide parameter ids, tied to the process and budget that saved it)"
            if fmt == 1
            else ""
        )
        raise CheckpointMismatchError(
            f"checkpoint {folder} has aidaptiv format {fmt}{old}; this version reads format {FORMAT}: resume it "
            "with the aidaptiv-ds version that saved it, or start again from another checkpoint"
        )
    if manifest.get("world_size") != world_size:
        raise CheckpointMismatchError(
            f"checkpoint {folder} was saved by {manifest.get('world_size')} ranks and this run has {world_size}: "
            "each rank's partition of every parameter is saved as DeepSpeed cut it, so resume with "
            f"{manifest.get('world_size')} ranks (any host budget, chunk size or node)"
        )
    for name, key in ((PARAMS, "params_bytes"), (OPTIM, "optim_bytes"), (BASE, "base_bytes")):
        if key not in manifest:  # no frozen base: no base.bin
            continue
        p = os.path.join(folder, name)
        size = os.path.getsize(p) if os.path.exists(p) else -1
        if size < manifest[key]:
            raise CheckpointDamagedError(
                f"checkpoint file {p} has {max(size, 0)} bytes, its manifest says {manifest[key]}: the checkpoint "
                "is damaged (not written by a completed save); resume from another one"
            )
    return folder, manifest


def resolve_checkpoint(path: str) -> str:
    """The tag folder of ``path``: a tag folder itself, or a save dir whose ``latest`` names one."""
    if not os.path.isdir(path):
        raise CheckpointMismatchError(
            f"checkpoint {path} does not exist: give a checkpoint folder of a run (its `save_dir`) or a tag folder in it"
        )
    if os.path.isdir(os.path.join(path, STATE_DIR)):
        return path
    tag = resolve_tag(path, None)
    if tag is not None:
        tag = os.path.join(path, tag)
        if os.path.isdir(os.path.join(tag, STATE_DIR)):
            return tag
        path = tag
    raise CheckpointMismatchError(
        f'checkpoint {path} has no aidaptiv/ folder: only checkpoints of runs with an "aidaptiv" '
        "block can be exported (plain DeepSpeed keeps weights in its own files; use DeepSpeed's "
        "zero_to_fp32.py for those)"
    )


class Checkpoint:
    """Every rank's manifest of one tag, checked to describe one model: each parameter's shape and its
    partitions' offsets in the ranks' params.bin files."""

    def __init__(self, tag_dir: str):
        self.tag_dir = tag_dir
        root = os.path.join(tag_dir, STATE_DIR)
        ranks = sorted(int(d[4:]) for d in os.listdir(root) if d.startswith("rank") and d[4:].isdigit())
        if not ranks:
            raise CheckpointDamagedError(
                f"checkpoint {tag_dir} has no rank folders in {root}: it is damaged or incomplete"
            )
        self.manifests: List[dict] = []
        self.folders: List[str] = []
        for r in ranks:
            folder = os.path.join(root, f"rank{r}")
            path = os.path.join(folder, MANIFEST)
            if not os.path.isfile(path):
                raise CheckpointDamagedError(
                    f"checkpoint {tag_dir}: {path} is missing: the save did not complete; export another checkpoint"
                )
            with open(path, encoding="utf-8") as f:
                m = json.load(f)
            if m.get("format") != FORMAT:
                raise CheckpointMismatchError(
                    f"checkpoint {folder} has aidaptiv format {m.get('format')}; this version "
                    f"exports format {FORMAT}: export it with the aidaptiv-ds version that saved it"
                )
            for name, key in ((PARAMS, "params_bytes"), (BASE, "base_bytes")):
                if key not in m:
                    continue
                path = os.path.join(folder, name)
                size = os.path.getsize(path) if os.path.exists(path) else -1
                if size < m[key]:
                    raise CheckpointDamagedError(
                        f"checkpoint file {path} has {max(size, 0)} bytes, "
                        f"its manifest says {m[key]}: the checkpoint is damaged"
                    )
            self.manifests.append(m)
            self.folders.append(folder)
        self.world_size = self.manifests[0]["world_size"]
        if ranks != list(range(self.world_size)):
            raise CheckpointMismatchError(
                f"checkpoint {tag_dir} was saved by {self.world_size} ranks but holds rank folders "
                f"{ranks}: copy every rank's aidaptiv/rank<r> folder (from every node) into it"
            )
        self.dtype = self.manifests[0]["model_dtype"]
        if self.dtype not in ELEMENT_BYTES:
            raise CheckpointMismatchError(
                f"checkpoint {tag_dir} holds {self.dtype} weights, which this exporter cannot write"
            )
        # name -> [per-rank (offset, partition_numel)], shape; in the order of rank 0's file
        self.parameters: Dict[str, dict] = {}
        by_rank = [{p["name"]: p for p in m["parameters"]} for m in self.manifests]
        for p in self.manifests[0]["parameters"]:
            name, numel = p["name"], _numel(p["shape"])
            parts = []
            for r, ps in enumerate(by_rank):
                q = ps.get(name)
                if q is None or q["shape"] != p["shape"] or q["partition_numel"] != p["partition_numel"]:
                    raise CheckpointMismatchError(
                        f"checkpoint {tag_dir}: parameter {name} differs between rank 0 and rank {r} "
                        "(missing, or another shape or partition): the rank folders are not of one save"
                    )
                parts.append((q.get("file", PARAMS), q["offset"]))
            if p["partition_numel"] * self.world_size < numel:
                raise CheckpointDamagedError(
                    f"checkpoint {tag_dir}: parameter {name} of shape {p['shape']} has partitions of "
                    f"{p['partition_numel']} elements on {self.world_size} ranks, too few to hold it"
                )
            self.parameters[name] = {
                "shape": p["shape"],
                "numel": numel,
                "partition_numel": p["partition_numel"],
                "offsets": parts,
            }
        if any(len(ps) != len(self.parameters) for ps in by_rank):
            raise CheckpointMismatchError(
                f"checkpoint {tag_dir}: the ranks' manifests list different parameters: the rank "
                "folders are not of one save"
            )
        self.has_adapters = any("lora_" in n for n in self.parameters)

    def nbytes(self, name: str) -> int:
        return self.parameters[name]["numel"] * ELEMENT_BYTES[self.dtype]

    def pieces(self, name: str):
        """(file, byte offset, byte count) of the ranks' slices of ``name``, in order, cut to its size."""
        p, esize = self.parameters[name], ELEMENT_BYTES[self.dtype]
        left = p["numel"]
        for r, (file, off) in enumerate(p["offsets"]):
            n = min(left, p["partition_numel"])
            if n <= 0:
                break
            yield os.path.join(self.folders[r], file), off, n * esize
            left -= n


def read_pieces(pieces, raw: memoryview, what: str, error=CheckpointDamagedError) -> None:
    """Copy the (file, byte offset, byte count) ``pieces`` one after another into ``raw``; a file that ends
    early raises ``error`` naming the file, the offset and ``what`` needed the bytes."""
    pos = 0
    for src, offset, nbytes in pieces:
        fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < nbytes:
                got = os.preadv(fd, [raw[pos + done : pos + nbytes]], offset + done)
                if got <= 0:
                    raise error(
                        f"file {src} ends at byte {offset + done}, {what} needs {nbytes - done} more: it is "
                        "truncated or damaged; copy, export or save it again"
                    )
                done += got
        finally:
            os.close(fd)
        pos += nbytes


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
