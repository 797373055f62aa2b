"""Attention keys and values of prompt prefixes kept on the SSD, so that a prompt that begins like one seen
before (a long document, a system prompt, a chat history) reads that part back instead of computing it again.

    store = PrefixKVStore(folder, model_identity, tokenizer_identity, max_bytes=8 << 30, host_bytes=1 << 30)
    hit = store.lookup(prompt_ids)         # (tokens reused, [(keys, values) per layer]) or None
    ...
    store.save(prompt_ids[:-1], layers)    # the prefix's keys and values, one (k, v) per layer

**Keyed by what made them.** Entries of one model and tokenizer live in a folder named by a digest of both
identities (:attr:`aidaptiv_ds.inference.sources.WeightSource.identity`, and a digest of the tokenizer files),
and each entry's header repeats both in full and lists its token ids: an entry made by another model, another
tokenizer or another version of the same folder is never used. A prompt reuses the longest common prefix it
shares with any entry (at most all its tokens but the last, whose logits start the generation).

**Laid out to be read in part.** The payload is in blocks of :data:`BLOCK` tokens, each block holding every
layer's keys then values for its tokens, each block 4 KiB aligned with its own CRC32: reusing the first M
tokens of an entry is one read of its first blocks (O_DIRECT, by the I/O engine), each block checked before
use.

**Never torn, never stale.** An entry is written to a temporary name, fsync'd, renamed, and the folder fsync'd;
a temporary file left by a crash is never looked up (and is removed when its writer is gone). A file whose
magic, header, size or a block's CRC is wrong is reported, removed and treated as a miss.

**Bounded.** ``max_bytes`` caps the folder on disk: after each save the entries used longest ago go first (a
hit refreshes the entry's time). ``host_bytes`` caps the entries also kept in RAM for the next hit (oldest use
first out); 0 keeps none.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import struct
import zlib
from typing import List, Optional, Sequence, Tuple

import torch

from aidaptiv_ds.common.durable import fsync_path
from aidaptiv_ds.common.sizes import align_up
from aidaptiv_ds.engine.io import IOEngine
from aidaptiv_ds.swap.host_memory import aligned_empty

log = logging.getLogger(__name__)

MAGIC = b"AIDKV001"
BLOCK = 256  # tokens per block
MIN_REUSE = 16  # fewer shared tokens than this are computed, not read

Layers = List[Tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (1, heads, tokens, head_dim)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixKVStore:
    """The prefix cache of one model and tokenizer in ``folder`` (see the module's docstring)."""

    def __init__(
        self,
        folder: str,
        model_identity: str,
        tokenizer_identity: str,
        max_bytes: int,
        host_bytes: int = 0,
        engine: Optional[IOEngine] = None,
    ):
        self.model_identity, self.tokenizer_identity = model_identity, tokenizer_identity
        self.folder = os.path.join(folder, _digest(model_identity, tokenizer_identity)[:24])
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self.max_bytes, self.host_bytes = int(max_bytes), int(host_bytes)
        self._own_engine = engine is None
        self.engine = engine or IOEngine()
        self._headers: dict = {}  # file name -> (mtime_ns, size, header)
        self._ram: "collections.OrderedDict[str, Layers]" = collections.OrderedDict()
        self._ram_bytes = 0
        self.stats = {"hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0, "damaged": 0, "evicted": 0}
        self._remove_orphans()

    # ------------------------------------------------------------------------------------------ entries

    def _entries(self) -> List[str]:
        return sorted(f for f in os.listdir(self.folder) if f.endswith(".kv") and not f.startswith("."))

    def _remove_orphans(self) -> None:
        """Temporary files of writers that are gone (a crash mid-write)."""
        for f in os.listdir(self.folder):
            if not f.startswith(".tmp-"):
                continue
            try:
                pid = int(f.split("-")[1])
                os.kill(pid, 0)
                continue  # its writer is alive (another process saving now)
            except (ValueError, IndexError, ProcessLookupError):
                pass
            except PermissionError:
                continue
            try:
                os.unlink(os.path.join(self.folder, f))
            except FileNotFoundError:
                pass

    def _drop(self, name: str, why: str) -> None:
        log.warning("KV cache entry %s %s: removed (it will be computed again)", os.path.join(self.folder, name), why)
        self.stats["damaged"] += 1
        self._forget(name)
        try:
            os.unlink(os.path.join(self.folder, name))
        except FileNotFoundError:
            pass

    def _forget(self, name: str) -> None:
        self._headers.pop(name, None)
        layers = self._ram.pop(name, None)
        if layers is not None:
            self._ram_bytes -= _layers_bytes(layers)

    def _header(self, name: str) -> Optional[dict]:
        path = os.path.join(self.folder, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._forget(name)
            return None
        known = self._headers.get(name)
        if known and known[0] == st.st_mtime_ns and known[1] == st.st_size:
            return known[2]
        try:
            with open(path, "rb") as f:
                head = f.read(16)
                if len(head) < 16 or head[:8] != MAGIC:
                    self._drop(name, "does not start with the cache's magic")
                    return None
                (n,) = struct.unpack("<Q", head[8:])
                header = json.loads(f.read(n)) if n < (64 << 20) else None
        except (OSError, ValueError) as e:
            self._drop(name, f"has an unreadable header ({e})")
            return None
        if not isinstance(header, dict) or "blocks" not in header:
            self._drop(name, "has an unreadable header")
            return None
        header["data_start"] = align_up(16 + n)
        end = header["data_start"] + max((b["offset"] + align_up(b["nbytes"]) for b in header["blocks"]), default=0)
        if st.st_size < end:
            self._drop(name, f"is {st.st_size} bytes, its header says {end}")
            return None
        if header.get("model") != self.model_identity or header.get("tokenizer") != self.tokenizer_identity:
            return None  # another model's (a digest collision of folder names): never used
        self._headers[name] = (st.st_mtime_ns, st.st_size, header)
        return header

    # ------------------------------------------------------------------------------------------ lookup

    def lookup(self, tokens: Sequence[int]) -> Optional[Tuple[int, Layers]]:
        """The longest stored prefix of ``tokens[:-1]`` (at least :data:`MIN_REUSE` tokens): (its length, the
        keys and values per layer), or None."""
        want = list(tokens[:-1])
        best, best_len = None, 0
        for name in self._entries():
            header = self._header(name)
            if header is None:
                continue
            n = _common_prefix(header["tokens"], want)
            if n > best_len:
                best, best_len = name, n
        if best is None or best_len < MIN_REUSE:
            self.stats["misses"] += 1
            return None
        layers = self._read(best, best_len)
        if layers is None:
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        try:
            os.utime(os.path.join(self.folder, best))  # used now: evicted last
            self._headers.pop(best, None)
        except OSError:
            pass
        return best_len, layers

    def _read(self, name: str, count: int) -> Optional[Layers]:
        header = self._headers[name][2]
        if name in self._ram:
            self._ram.move_to_end(name)
            return [(k[:, :, :count], v[:, :, :count]) for k, v in self._ram[name]]
        blocks = header["blocks"][: (count + BLOCK - 1) // BLOCK]
        start, end = blocks[0]["offset"], blocks[-1]["offset"] + align_up(blocks[-1]["nbytes"])
        buf = aligned_empty(end - start)
        path = os.path.join(self.folder, name)
        try:
            self.engine.read(buf, path, header["data_start"] + start)
        except OSError as e:
            self._drop(name, f"could not be read ({e})")
            return None
        self.stats["bytes_read"] += end - start
        dtype = getattr(torch, header["dtype"])
        keys: List[list] = [[] for _ in header["shapes"]]
        values: List[list] = [[] for _ in header["shapes"]]
        for b in blocks:
            raw = buf[b["offset"] - start : b["offset"] - start + b["nbytes"]]
            if zlib.crc32(memoryview(raw.numpy())) != b["crc"]:
                self._drop(name, f"has a damaged block at byte {b['offset']} (CRC32 mismatch)")
                return None
            pos = 0
            for i, (heads, dim_k, dim_v) in enumerate(header["shapes"]):
                for out, dim in ((keys[i], dim_k), (values[i], dim_v)):
                    n = heads * b["tokens"] * dim * dtype.itemsize
                    out.append(raw[pos : pos + n].view(dtype).view(1, heads, b["tokens"], dim))
                    pos += n
        layers = [(torch.cat(k, dim=2), torch.cat(v, dim=2)) for k, v in zip(keys, values)]
        if count == len(header["tokens"]):
            self._keep_in_ram(name, layers)
        return [(k[:, :, :count], v[:, :, :count]) for k, v in layers]

    def _keep_in_ram(self, name: str, layers: Layers) -> None:
        size = _layers_bytes(layers)
        if size > self.host_bytes:
            return
        while self._ram and self._ram_bytes + size > self.host_bytes:
            _, old = self._ram.popitem(last=False)
            self._ram_bytes -= _layers_bytes(old)
        self._ram[name] = layers
        self._ram_bytes += size

    # ------------------------------------------------------------------------------------------ save

    def save(self, tokens: Sequence[int], layers: Layers) -> Optional[str]:
        """Store the keys and values of ``tokens`` (batch 1: each tensor (1, heads, len(tokens), head_dim)).
        Returns the entry's path, or None when it was not stored (too short, or the disk refused: a warning
        says why; generation goes on)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < MIN_REUSE:
            return None
        if any(k.shape[0] != 1 or k.shape[2] != len(tokens) or v.shape[2] != len(tokens) for k, v in layers):
            raise ValueError("PrefixKVStore.save: keys and values must be (1, heads, tokens, dim) for every token")
        name = _tokens_digest(tokens)[:40] + ".kv"
        if os.path.exists(os.path.join(self.folder, name)):
            return os.path.join(self.folder, name)
        dtype = layers[0][0].dtype
        shapes = [(int(k.shape[1]), int(k.shape[3]), int(v.shape[3])) for k, v in layers]
        per_token = sum(h * (dk + dv) for h, dk, dv in shapes) * dtype.itemsize
        blocks, offset = [], 0
        for first in range(0, len(tokens), BLOCK):
            n = min(BLOCK, len(tokens) - first)
            blocks.append({"offset": offset, "tokens": n, "nbytes": n * per_token, "first": first})
            offset += align_up(n * per_token)
        payload = aligned_empty(offset)
        for b in blocks:
            pos, lo, hi = b["offset"], b["first"], b["first"] + b["tokens"]
            for k, v in layers:
                for t in (k, v):
                    part = t[:, :, lo:hi].contiguous().view(torch.uint8).reshape(-1)
                    payload[pos : pos + part.numel()].copy_(part)
                    pos += part.numel()
            b["crc"] = zlib.crc32(memoryview(payload[b["offset"] : b["offset"] + b["nbytes"]].numpy()))
        header = {
            "model": self.model_identity,
            "tokenizer": self.tokenizer_identity,
            "tokens": tokens,
            "dtype": str(dtype).replace("torch.", ""),
            "shapes": shapes,
            "blocks": blocks,  # offsets from the payload's start, the first ALIGN boundary after the header
        }
        encoded = MAGIC + struct.pack("<Q", 0) + json.dumps(header, separators=(",", ":")).encode()
        encoded = MAGIC + struct.pack("<Q", len(encoded) - 16) + encoded[16:]
        head = aligned_empty(align_up(len(encoded)))
        head.zero_()
        head[: len(encoded)].copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
        tmp = os.path.join(self.folder, f".tmp-{os.getpid()}-{name}")
        try:
            handle = self.engine.open(tmp, create=True, exclusive=True)
            try:
                self.engine.write(head, handle, 0)
                self.engine.write(payload, handle, head.numel())
            finally:
                self.engine.close(handle)
            fsync_path(tmp)
            os.replace(tmp, os.path.join(self.folder, name))
            fsync_path(self.folder)
        except OSError as e:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            what = "the disk is full" if e.errno == errno.ENOSPC else str(e)
            log.warning("KV cache: prefix of %d tokens not stored in %s: %s", len(tokens), self.folder, what)
            return None
        self.stats["bytes_written"] += head.numel() + payload.numel()
        self._evict()
        return os.path.join(self.folder, name)

    def _evict(self) -> None:
        entries = []
        for name in self._entries():
            try:
                st = os.stat(os.path.join(self.folder, name))
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, name))
        entries.sort()
        total = sum(size for _, size, _ in entries)
        for _, size, name in entries:
            if total <= self.max_bytes:
                break
            self._forget(name)
            try:
                os.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass
            total -= size
            self.stats["evicted"] += 1

    def close(self) -> None:
        if self._own_engine and self.engine is not None:
            self.engine.shutdown()
        self.engine = None


def _layers_bytes(layers: Layers) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


__all__ = ["PrefixKVStore", "BLOCK", "MIN_REUSE"]
