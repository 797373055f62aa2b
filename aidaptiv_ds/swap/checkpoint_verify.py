"""Whether a checkpoint is what its save wrote: checksums written with every file, checked before a load, and
weights and optimizer state that must be finite.

- Our files (``aidaptiv/rank<r>/params.bin`` and ``optim.bin``): a CRC32 of every block as the save writes it,
  kept in the rank's manifest (``checksums``), so a damaged block is named by file and byte range. The same
  pass checks that the bytes holding parameters (the model dtype) and optimizer state (fp32 masters and
  moments) are finite: a save of NaN or inf weights fails instead of becoming ``latest``.
- Every other file of the tag (DeepSpeed's ``*_model_states.pt`` and ``*_optim_states.pt``): size and CRC32 in
  ``<tag>/checksums.json``, written by the rank that publishes the tag once DeepSpeed has written them. The
  folder ``hf/`` (config and tokenizer files the train job adds after the save) is not listed.

:func:`verify_tag` reads the tag once more before a resume and refuses, with the file, the offset and what to
do, a file that changed, a file the save did not write, or a non-finite value; :func:`verify_weights` checks
the same way what an export or a generation reads (every rank's params.bin), each reader saying its own what
to do (:data:`AGAIN`, :data:`EXPORT_AGAIN`, :data:`GENERATE_AGAIN`). CRC32 finds damage (flipped bits, torn or
truncated writes, files swapped between tags), not a forger who rewrites the manifest and checksums.json too;
what stands in that one's way is that every pickle of the tag is loaded as data only, on a resume before
DeepSpeed loads anything (:func:`aidaptiv_ds.zero3.checkpoint_trust.check_pickles_are_data`) and by DeepSpeed's own
load (:mod:`aidaptiv_ds.zero3.compat`, ``checkpoint_loads_as_data``). A checkpoint saved before checksums
existed loads with a warning that it was not verified. The refusals it raises are the format's
(:mod:`aidaptiv_ds.swap.checkpoint_format`). Nothing here needs DeepSpeed.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import zlib
from typing import Dict, List, Tuple

import torch

from aidaptiv_ds.swap.checkpoint_format import (
    BASE,
    MANIFEST,
    MODEL_FILES,
    OPTIM,
    PARAMS,
    STATE_DIR,
    CheckpointDamagedError,
    CheckpointMismatchError,
)

log = logging.getLogger(__name__)

ALGORITHM = "crc32"
CHECKSUMS = "checksums.json"  # <tag>/checksums.json: the tag's files outside aidaptiv/ and hf/
UNLISTED_DIRS = (STATE_DIR, MODEL_FILES)  # covered by the manifests / written after the save
READ_BLOCK = 16 << 20  # bytes read at a time when verifying (plain reads, outside the host budget)

# What to do about a refused checkpoint, by who reads it: a resume, an export, a generation.
AGAIN = "resume from another checkpoint (--resume auto takes the newest one that verifies)"
EXPORT_AGAIN = "export another checkpoint of the run (another tag of its save dir)"
GENERATE_AGAIN = "generate from another checkpoint of the run (another tag of its save dir) or from its export"

# (file offset, bytes, dtype, what the bytes hold) of a range that must hold finite values
Range = Tuple[int, int, torch.dtype, str]


def _valid_numel(manifest: dict) -> Dict[str, int]:
    """Elements of each parameter's partition on this rank that belong to the parameter: ZeRO pads the last
    ranks' partitions, and the padding holds whatever its buffer held (not values; training never reads it)."""
    rank = manifest.get("rank", 0)
    out = {}
    for p in manifest["parameters"]:
        total = 1
        for d in p["shape"]:
            total *= int(d)
        out[p["name"]] = max(0, min(p["partition_numel"], total - rank * p["partition_numel"]))
    return out


def param_ranges(manifest: dict, file: str = PARAMS) -> List[Range]:
    """The ranges of ``file`` (params.bin, or base.bin for a frozen base) holding each parameter's partition (in
    the model dtype), without ZeRO's padding and without parameters that do not hold numbers (a QLoRA base's
    packed 4-bit data: ``"values": false``)."""
    dtype = getattr(torch, manifest["model_dtype"])
    size = torch.tensor([], dtype=dtype).element_size()
    valid = _valid_numel(manifest)
    out = [
        (p["offset"], valid[p["name"]] * size, dtype, f"parameter {p['name']}")
        for p in manifest["parameters"]
        if p.get("values", True) and valid[p["name"]] > 0 and p.get("file", PARAMS) == file
    ]
    return sorted(out)


def optim_ranges(manifest: dict) -> List[Range]:
    """The ranges of optim.bin holding each chunk's fp32 master (unless the parameter is the master) and
    optimizer state: each piece of a parameter in a chunk's parts, without ZeRO's padding and without the
    padding that aligns each part to 4 KiB."""
    valid = _valid_numel(manifest)
    packed = {p["name"] for p in manifest["parameters"] if not p.get("values", True)}
    out = []
    for g in manifest["sub_groups"]:
        # A sub-group that never stepped holds no state yet (its slots are not values); its master always is.
        names = list(g.get("state_keys") or ["state 0", "state 1"])
        holds = [bool(g.get("state_valid"))] * len(names)
        if not manifest["master_is_parameter"]:
            names, holds = ["fp32 master"] + names, [True] + holds
        for i, c in enumerate(g["chunks"]):
            for name, start, numel, flat in c["pieces"]:
                n = max(0, min(start + numel, valid.get(name, start + numel)) - start)
                if n == 0 or name in packed:
                    continue
                for k, what in enumerate(names):
                    if holds[k]:
                        offset = c["offset"] + k * c["part"] + flat * 4
                        out.append((offset, n * 4, torch.float32, f"{what} of {name} (chunk {i})"))
    return sorted(out)


class FileInspector:
    """Watches the bytes of one file go by, in increasing offsets: a CRC32 per block (:meth:`see` at save,
    :meth:`check` at load) and finite values in its :data:`Range` s."""

    def __init__(self, path: str, ranges: List[Range], advice: str = AGAIN):
        self.path, self.ranges, self.advice = path, ranges, advice
        self.starts = [r[0] for r in ranges]
        self.blocks: List[List[int]] = []  # [offset, bytes, crc32]
        self.at_save = True  # what a non-finite value means: a diverged run (save) or a damaged file (load)

    def see(self, offset: int, data: torch.Tensor) -> None:
        """A block written at ``offset`` (a uint8 tensor on the CPU): its checksum is recorded, its values checked."""
        self.finite(offset, data)
        self.blocks.append([offset, data.numel(), zlib.crc32(data.numpy())])

    def hole(self, offset: int, nbytes: int) -> None:
        """Bytes this file does not hold (params.bin's frozen parameters, which are in base.bin, and base.bin's
        trained ones): recorded as such (a checksum of None), so the blocks still cover the file and a manifest
        whose blocks were cut out is still found."""
        if nbytes > 0:
            self.blocks.append([offset, nbytes, None])

    def seen(self, blocks: List[List[int]]) -> None:
        """The blocks of a file written before and linked here (a frozen base: the same bytes)."""
        self.blocks.extend([list(b) for b in blocks])

    def finite(self, offset: int, data: torch.Tensor) -> None:
        end = offset + data.numel()
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while i < len(self.ranges) and self.ranges[i][0] < end:
            r_off, r_len, dtype, what = self.ranges[i]
            lo, hi = max(r_off, offset), min(r_off + r_len, end)
            size = torch.tensor([], dtype=dtype).element_size()
            lo += (r_off - lo) % size  # a block boundary inside an element: start at the next whole one
            hi -= (hi - r_off) % size
            if hi > lo:
                values = data[lo - offset : hi - offset].view(dtype)
                ok = torch.isfinite(values)
                if not bool(ok.all()):
                    first = int((~ok).nonzero()[0])
                    raise CheckpointDamagedError(
                        f"checkpoint file {self.path} holds a non-finite value ({values[first].item()}) in {what} "
                        f"at byte offset {lo + first * size}: "
                        + (
                            "the training diverged before this save, so it was not published; lower the learning "
                            "rate or check the data, and resume from the last good checkpoint"
                            if self.at_save
                            else f"the file was damaged after its save; {self.advice}"
                        )
                    )
            i += 1

    def check(self, expected: List[List[int]], size_needed: int) -> None:
        """Read the file's recorded blocks back and compare each CRC32 (and the finite ranges)."""
        self.at_save = False
        covered = 0
        for off, n, crc in sorted(expected):
            if crc is None and any(r[0] < off + n and off < r[0] + r[1] for r in self.ranges):
                raise CheckpointDamagedError(
                    f"checkpoint file {self.path}: its manifest says bytes {off}-{off + n} are not in it, where a "
                    f"parameter of this file lies: the manifest was changed after the save; {self.advice}"
                )
            if off != covered:
                raise CheckpointDamagedError(
                    f"checkpoint file {self.path}: its manifest's checksums skip bytes {covered}-{off}: the manifest "
                    f"was changed after the save; {self.advice}"
                )
            covered = off + n
        if covered < size_needed:
            raise CheckpointDamagedError(
                f"checkpoint file {self.path}: its checksums cover {covered} of the {size_needed} bytes the manifest "
                f"names: the manifest was changed after the save; {self.advice}"
            )
        buf = torch.empty(
            min(READ_BLOCK, max((n for _, n, c in expected if c is not None), default=1)), dtype=torch.uint8
        )
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            for off, n, crc in expected:
                if crc is None:  # a hole: its bytes are in the rank's other parameter file
                    continue
                got, done = 0, 0
                while done < n:
                    view = buf[: min(len(buf), n - done)]
                    _pread_exactly(fd, self.path, off + done, view, self.advice)
                    self.finite(off + done, view)
                    got = zlib.crc32(view.numpy(), got)
                    done += len(view)
                if got != crc:
                    raise CheckpointDamagedError(
                        f"checkpoint file {self.path}: bytes {off}-{off + n} do not match the checksum written with "
                        f"them (crc32 {crc:08x}, read {got:08x}): the file was changed or damaged after the save; "
                        f"{self.advice}"
                    )
        finally:
            os.close(fd)


def _pread_exactly(fd: int, path: str, offset: int, view: torch.Tensor, advice: str) -> None:
    mv = memoryview(view.numpy())
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n == 0:
            raise CheckpointDamagedError(
                f"checkpoint file {path} is truncated: wanted {len(mv)} bytes at offset {offset}, got {done}; {advice}"
            )
        done += n


def inspectors(folder: str, manifest: dict, advice: str = AGAIN) -> Dict[str, FileInspector]:
    """The inspectors of a rank's params.bin and optim.bin, from its manifest (or the one being written)."""
    out = {
        PARAMS: FileInspector(os.path.join(folder, PARAMS), param_ranges(manifest), advice),
        OPTIM: FileInspector(os.path.join(folder, OPTIM), optim_ranges(manifest), advice),
    }
    if "base_bytes" in manifest:  # a frozen base, in its own file
        out[BASE] = FileInspector(os.path.join(folder, BASE), param_ranges(manifest, BASE), advice)
    return out


def verify_rank(folder: str, manifest: dict, files=(PARAMS, BASE, OPTIM), advice: str = AGAIN) -> bool:
    """Check a rank's ``files`` (params.bin and optim.bin) against the checksums of its manifest, and their
    values where they must be finite; False when the manifest has none (a checkpoint saved before checksums
    existed), after which nothing was checked. Reads through one buffer of at most :data:`READ_BLOCK` bytes."""
    sums = manifest.get("checksums")
    if not sums:
        return False
    if sums.get("algorithm") != ALGORITHM:
        raise _unknown_algorithm(folder, sums.get("algorithm"))
    needed = {PARAMS: manifest["params_bytes"], OPTIM: manifest["optim_bytes"], BASE: manifest.get("base_bytes", 0)}
    for name, insp in inspectors(folder, manifest, advice).items():
        if name in files:
            insp.check(sums.get(name) or [], needed[name])
    return True


def verify_weights(ck, advice: str) -> bool:
    """Check what an export or a generation reads of a checkpoint (a
    :class:`aidaptiv_ds.swap.checkpoint_format.Checkpoint`): every rank's params.bin, each block against its
    CRC32 and each parameter that holds numbers for finite values, as a resume checks it, refusing with the
    file, the byte range or offset, and ``advice``. optim.bin is not read (neither reads it). False when the
    manifests have no checksums (saved before they existed): nothing was checked."""
    checked = True
    for folder, manifest in zip(ck.folders, ck.manifests):
        try:
            checked = verify_rank(folder, manifest, files=(PARAMS, BASE), advice=advice) and checked
        except CheckpointMismatchError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a manifest changed by hand or damaged
            raise _malformed(folder, e, advice) from None
    return checked


def _unknown_algorithm(folder: str, algorithm) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"checkpoint {folder}: checksums of algorithm {algorithm!r}, this version knows {ALGORITHM!r}: read it with "
        "the aidaptiv-ds version that saved it"
    )


def _malformed(folder: str, error: BaseException, advice: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"checkpoint manifest {os.path.join(folder, MANIFEST)} is malformed ({type(error).__name__}: {error}): {advice}"
    )


def file_crc32(path: str) -> Tuple[int, int]:
    """(size, CRC32) of a whole file."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(READ_BLOCK)
            if not block:
                return size, crc
            crc = zlib.crc32(block, crc)
            size += len(block)


def tag_files(tag_dir: str) -> List[str]:
    """The tag's files outside aidaptiv/ and hf/, relative to it, except checksums.json."""
    out = []
    for root, dirs, files in os.walk(tag_dir):
        rel_root = os.path.relpath(root, tag_dir)
        if rel_root == ".":
            dirs[:] = [d for d in dirs if d not in UNLISTED_DIRS]
        for f in files:
            rel = os.path.normpath(os.path.join(rel_root, f))
            if rel != CHECKSUMS:
                out.append(rel)
    return sorted(out)


def write_tag_checksums(tag_dir: str) -> None:
    """Write ``<tag_dir>/checksums.json`` for the tag's files outside aidaptiv/ and hf/ (DeepSpeed's), fsync'd."""
    entries = {}
    for rel in tag_files(tag_dir):
        size, crc = file_crc32(os.path.join(tag_dir, rel))
        entries[rel] = [size, crc]
    path = os.path.join(tag_dir, CHECKSUMS)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"algorithm": ALGORITHM, "files": entries}, f)
        f.flush()
        os.fsync(f.fileno())


def verify_tag_files(tag_dir: str) -> bool:
    """Check the tag's files outside aidaptiv/ and hf/ against ``checksums.json``: each listed file there with
    its size and CRC32, and no other file. False when the tag has no checksums.json (saved before it existed)."""
    path = os.path.join(tag_dir, CHECKSUMS)
    if not os.path.exists(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            listed = json.load(f)
        files = listed["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointDamagedError(f"checkpoint file {path} cannot be read ({e}): {AGAIN}") from None
    if listed.get("algorithm") != ALGORITHM:
        raise _unknown_algorithm(tag_dir, listed.get("algorithm"))
    present = set(tag_files(tag_dir))
    extra = sorted(present - set(files))
    if extra:
        raise CheckpointDamagedError(
            f"checkpoint {tag_dir} holds files its save did not write ({', '.join(extra[:5])}): they were added "
            f"after the save and are not loaded; {AGAIN}"
        )
    for rel, entry in sorted(files.items()):
        full = os.path.join(tag_dir, rel)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, int) for x in entry)):
            raise CheckpointDamagedError(f"checkpoint file {path} is malformed (entry {rel!r}): {AGAIN}")
        size, crc = entry
        if not os.path.isfile(full) or os.path.islink(full):
            raise CheckpointDamagedError(f"checkpoint file {full} is missing: {AGAIN}")
        got_size, got_crc = file_crc32(full)
        if (got_size, got_crc) != (size, crc):
            raise CheckpointDamagedError(
                f"checkpoint file {full} is not what its save wrote ({got_size} bytes, crc32 {got_crc:08x}; the save "
                f"wrote {size} bytes, crc32 {crc:08x}): it was changed or damaged; {AGAIN}"
            )
    return True


def verify_tag(tag_dir: str, folder: str, manifest: dict) -> None:
    """Everything of a tag one rank loads: DeepSpeed's files (``tag_dir``) and the rank's swapped state
    (``folder`` and its ``manifest``). Raises :class:`CheckpointDamagedError` naming the file, and logs a
    warning when the tag predates checksums."""
    files_checked = verify_tag_files(tag_dir)
    try:
        state_checked = verify_rank(folder, manifest)
    except CheckpointMismatchError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a manifest changed by hand or damaged
        raise _malformed(folder, e, AGAIN) from None
    if not (files_checked and state_checked):
        log.warning(
            "aidaptiv: checkpoint %s has no checksums (saved before aidaptiv-ds wrote them): its files are not "
            "verified",
            tag_dir,
        )
