"""Where a model's weights come from for generation: a Hugging Face folder's safetensors files, or one of our
checkpoints (the per-rank ``params.bin`` files, read with :mod:`aidaptiv_ds.swap.checkpoint_format`, as the
export reads them), as one table of tensors whose bytes are known pieces of files.

Nothing is loaded here: :class:`WeightSource` reads the safetensors headers (or the checkpoint manifests), so
the table of a 70B model costs kilobytes, and :meth:`WeightSource.read_into` copies one tensor's bytes into a
buffer the caller owns (a pinned slot), so no tensor is ever held twice. Each folder's problems are said in
one :class:`ModelSourceError`: no weights, weights only in pickle files, a LoRA checkpoint whose adapters are
not merged, a header that is not safetensors', a safetensors file the safetensors library itself would refuse
(offsets that overlap, leave gaps or run past the end, sizes that are not dtype x shape), naming the file and
the tensor (read as they are, such offsets would give a tensor another's bytes), and a checkpoint whose weights
do not verify (their checksums, or NaN/inf values: what a resume refuses).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from aidaptiv_ds.swap.checkpoint_format import (
    LATEST,
    MANIFEST,
    MODEL_FILES,
    PARAMS,
    STATE_DIR,
    Checkpoint,
    CheckpointMismatchError,
    read_pieces,
    resolve_checkpoint,
)
from aidaptiv_ds.swap.checkpoint_verify import GENERATE_AGAIN, verify_weights

log = logging.getLogger(__name__)

# safetensors' dtype names, and torch's names as our checkpoint manifests write them
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own limit on a header


class ModelSourceError(ValueError):
    """A model folder or checkpoint that cannot be generated from, with what to do about it."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the source: its shape, dtype and the (file, offset, nbytes) pieces its bytes are in."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    pieces: Tuple[Tuple[str, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.pieces)


class WeightSource:
    """The tensors of a model folder or checkpoint, and the folder holding its config and tokenizer files.

    ``kind`` is "hf" or "checkpoint"; ``files_dir`` has config.json and the tokenizer; ``tensors`` maps
    names to :class:`TensorEntry`; ``identity`` is a digest of the config and of every weight file's header,
    size and modification time (a different model, or the same folder rewritten, gets another identity)."""

    def __init__(self, kind: str, path: str, files_dir: str, tensors: Dict[str, TensorEntry], identity: str):
        self.kind, self.path, self.files_dir, self.tensors, self.identity = kind, path, files_dir, tensors, identity

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.files_dir, local_files_only=True)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy tensor ``name``'s bytes into ``out`` (a contiguous CPU uint8 tensor of exactly its size)."""
        entry = self.tensors[name]
        if out.numel() != entry.nbytes or out.dtype != torch.uint8:
            raise ValueError(f"read_into {name}: buffer of {out.numel()} bytes for a tensor of {entry.nbytes}")
        self.read_range_into(name, 0, out)

    def read_range_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Copy bytes ``start`` .. ``start + out.numel()`` of tensor ``name`` into ``out`` (contiguous CPU uint8):
        a table too large for one buffer is laid out piece by piece."""
        entry = self.tensors[name]
        end = start + out.numel()
        if out.dtype != torch.uint8 or start < 0 or end > entry.nbytes:
            raise ValueError(f"read_range_into {name}: bytes {start}..{end} of a tensor of {entry.nbytes}")
        pieces, pos = [], 0  # the part of each piece that falls in [start, end)
        for src, offset, nbytes in entry.pieces:
            lo, hi = max(start, pos), min(end, pos + nbytes)
            if lo < hi:
                pieces.append((src, offset + lo - pos, hi - lo))
            pos += nbytes
        read_pieces(pieces, memoryview(out.numpy()), f"tensor {name}", ModelSourceError)


def _file_identity(path: str, header: bytes) -> str:
    st = os.stat(path)
    return f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}:{hashlib.sha256(header).hexdigest()}"


def _config_text(folder: str) -> str:
    with open(os.path.join(folder, "config.json"), "rb") as f:
        return f.read().decode(errors="replace")


def _digest(parts: List[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def read_safetensors_header(path: str) -> Tuple[dict, int, bytes]:
    """(header, byte offset of the data, raw header bytes) of one safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelSourceError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT:
            raise ModelSourceError(f"{path} is not a safetensors file (its header would be {n:,} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"{path} is not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ModelSourceError(f"{path} is not a safetensors file (its header is not a JSON object)")
    return header, 8 + n, raw


def from_hf_folder(folder: str) -> WeightSource:
    """The safetensors weights of a Hugging Face model folder (one file, or shards with or without an index)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelSourceError(
            f"{folder} has no config.json: give a Hugging Face model folder (config.json, *.safetensors, tokenizer "
            "files), a folder written by 'aidaptiv-ds export', or a checkpoint of 'aidaptiv-ds train'"
        )
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        pickles = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth"))]
        raise ModelSourceError(
            f"{folder} has no *.safetensors weights"
            + (
                f" (only {', '.join(pickles[:3])}: pickle files are not read, they can run code; convert them with "
                "transformers' save_pretrained(safe_serialization=True))"
                if pickles
                else ": the folder holds no model weights"
            )
        )
    tensors: Dict[str, TensorEntry] = {}
    identity = [_config_text(folder)]
    for fname in files:
        path = os.path.join(folder, fname)
        header, data_start, raw = read_safetensors_header(path)
        identity.append(_file_identity(path, raw))
        for name, (dtype, shape, begin, end) in _checked_entries(path, header, os.path.getsize(path) - data_start):
            if name in tensors:
                raise ModelSourceError(f"{folder}: tensor {name} is in two weight files; keep one copy of the shards")
            tensors[name] = TensorEntry(name, shape, dtype, ((path, data_start + begin, end - begin),))
    return WeightSource("hf", folder, folder, tensors, _digest(identity))


def _checked_entries(path: str, header: dict, data_bytes: int) -> List[Tuple[str, tuple]]:
    """(name, (dtype, shape, begin, end)) of every tensor of one safetensors file, checked as the safetensors
    library checks them before transformers loads a byte: a known dtype and a shape of whole numbers; bytes
    dtype x shape long; the tensors' bytes, in offset order, tiling the data that follows the header exactly
    (no overlap, no gap, nothing past the end or left over). A file that breaks one of these is damaged or
    forged, and read as it is it would give some tensor another's bytes (overlapping offsets) or bytes from
    past its end: refused, naming the file and the tensor."""
    damaged = "the file is damaged; download or export it again"
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict):
            raise ModelSourceError(f"{path}: tensor {name}'s header entry is not an object: {damaged}")
        dtype = _ST_DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise ModelSourceError(
                f"{path}: tensor {name} has dtype {meta.get('dtype')!r}, which is not one of "
                f"{', '.join(_ST_DTYPES)}: the file is damaged or of a dtype generate does not read"
            )
        shape, offsets = meta.get("shape"), meta.get("data_offsets")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ModelSourceError(f"{path}: tensor {name} has shape {shape!r}, not a list of sizes: {damaged}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelSourceError(f"{path}: tensor {name} has data_offsets {offsets!r}, not [begin, end]: {damaged}")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize:
            raise ModelSourceError(
                f"{path}: tensor {name} is {meta['dtype']} {shape}, {numel * dtype.itemsize:,} bytes, but its "
                f"data_offsets {begin}..{end} hold {end - begin:,}: {damaged}"
            )
        out.append((name, (dtype, tuple(shape), begin, end)))
    at, previous = 0, None
    for name, (_, _, begin, end) in sorted(out, key=lambda e: (e[1][2], e[1][3])):
        if begin < at:
            raise ModelSourceError(
                f"{path}: tensor {name}'s bytes {begin}..{end} overlap tensor {previous}'s, which end at {at}: "
                f"one tensor would be read from another's bytes; {damaged}"
            )
        if begin > at:
            raise ModelSourceError(f"{path}: bytes {at}..{begin} before tensor {name} belong to no tensor: {damaged}")
        at, previous = end, name
    if at > data_bytes:
        raise ModelSourceError(
            f"{path}: tensor {previous}'s bytes end at {at:,} but the file holds {data_bytes:,} after its header: "
            f"the file is truncated; {damaged}"
        )
    if at < data_bytes:
        raise ModelSourceError(
            f"{path}: {data_bytes - at:,} bytes after the last tensor ({previous}) belong to no tensor: {damaged}"
        )
    return out


def from_checkpoint(path: str) -> WeightSource:
    """The model of one of our checkpoints (a save dir, its latest tag, or a tag folder)."""
    try:
        tag = resolve_checkpoint(path)
        ck = Checkpoint(tag)
    except CheckpointMismatchError as e:
        raise ModelSourceError(str(e)) from None
    if ck.has_adapters:
        raise ModelSourceError(
            f"checkpoint {tag} holds LoRA adapters: merge them first with 'aidaptiv-ds export {path} --out DIR "
            "--merge-lora' and generate from DIR"
        )
    files_dir = os.path.join(tag, MODEL_FILES)
    if not os.path.isfile(os.path.join(files_dir, "config.json")):
        raise ModelSourceError(
            f"checkpoint {tag} has no {MODEL_FILES}/config.json (saved by an older aidaptiv-ds): export it with "
            "'aidaptiv-ds export --model PRESET' and generate from the folder"
        )
    # The weights a resume would refuse are refused here too (CRC32 of each block of params.bin, finite values):
    # one read of the checkpoint before the generator lays it out.
    try:
        verified = verify_weights(ck, GENERATE_AGAIN)
    except CheckpointMismatchError as e:
        raise ModelSourceError(str(e)) from None
    if not verified:
        log.warning(
            "checkpoint %s has no checksums (saved before aidaptiv-ds wrote them): its weights are not verified", tag
        )
    dtype = getattr(torch, ck.dtype)
    tensors = {
        name: TensorEntry(name, tuple(p["shape"]), dtype, tuple(ck.pieces(name))) for name, p in ck.parameters.items()
    }
    identity = [_config_text(files_dir)]
    for folder in ck.folders:
        for f in (MANIFEST, PARAMS):
            p = os.path.join(folder, f)
            identity.append(_file_identity(p, b"") if os.path.exists(p) else f)
    return WeightSource("checkpoint", tag, files_dir, tensors, _digest(identity))


def open_source(path: str) -> WeightSource:
    """A Hugging Face folder or a checkpoint of ours, told apart by what the folder holds."""
    if not os.path.isdir(path):
        raise ModelSourceError(
            f"`model` {path} is not a folder: give a Hugging Face model folder or a checkpoint of 'aidaptiv-ds train'"
        )
    if os.path.isdir(os.path.join(path, STATE_DIR)) or os.path.isfile(os.path.join(path, LATEST)):
        return from_checkpoint(path)
    return from_hf_folder(path)
