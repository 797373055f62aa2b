"""Checkpoints of the state that lives in our swap space.

DeepSpeed 0.19 saves a ZeRO-3 run with the optimizer on NVMe by copying the swapper's folder, and on load
copies it back and skips the optimizer's state dict: Adam restarts from zero state and the learning rate
reads 0, so a resumed run drifts from the uninterrupted one. Ours adds, next to DeepSpeed's files, a folder
per rank with every byte the resumed run needs::

    <save_dir>/<tag>/aidaptiv/rank<r>/
        params.bin     every parameter partition (model dtype), in the swap file's layout
        optim.bin      per optimizer sub-group: fp32 master and the optimizer's state tensors
        manifest.json  layout, optimizer scalars (Adam's step count), hyperparameters, model shape

The folder is written under a temporary name and renamed when complete, and it is written before
DeepSpeed's own files (which end by updating ``latest``), so a save that fails half-way (disk full,
file-size limit) raises with the file and errno and leaves the last complete checkpoint as it was.
Data moves through the pinned pool with the engine (O_DIRECT where the checkpoint filesystem allows it).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Dict, List, Optional

import torch

log = logging.getLogger(__name__)

FORMAT = 1
CHUNK = 64 * 1024 * 1024


class CheckpointMismatchError(ValueError):
    pass


def rank_dir(root: str, tag: str, rank: int) -> str:
    return os.path.join(root, str(tag), "aidaptiv", f"rank{rank}")


def _resolve_tag(engine, root: str, tag: Optional[str], saving: bool) -> str:
    if tag is not None:
        return str(tag)
    if saving:
        return f"global_step{engine.global_steps}"  # DeepSpeed's default tag
    latest = os.path.join(root, "latest")
    with open(latest, encoding="utf-8") as f:
        return f.read().strip()


class _Mover:
    """Copies between a swap file and a checkpoint file through one pinned buffer."""

    def __init__(self, runtime):
        self.runtime = runtime
        # Up to CHUNK, and never more than an eighth of the budget (resident state may hold the rest).
        size = max(1 << 20, min(CHUNK, runtime.memory.capacity // 8) // (1 << 20) * (1 << 20))
        self.buf = runtime.memory.take(size, "checkpoint transfer buffer")
        self.chunk = size

    def open(self, path: str, create: bool):
        try:
            return self.runtime.engine.open(path, create=create, exclusive=create)
        except OSError as e:
            if e.errno == 22:  # EINVAL: this filesystem refuses O_DIRECT (e.g. tmpfs)
                return _BufferedFile(path, create)
            raise

    def copy(self, src, src_off: int, dst, dst_off: int, nbytes: int) -> None:
        """src/dst are engine files or _BufferedFile; offsets of engine files are 4 KiB aligned."""
        done = 0
        while done < nbytes:
            n = min(self.chunk, nbytes - done)
            view = self.buf[:n]
            _read(self.runtime, src, src_off + done, view)
            _write(self.runtime, dst, dst_off + done, view)
            done += n


class _BufferedFile:
    def __init__(self, path: str, create: bool):
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | ((os.O_CREAT | os.O_EXCL) if create else 0)
        self.path = path
        self.fd = os.open(path, flags, 0o600)

    def close(self):
        os.fsync(self.fd)
        os.close(self.fd)


def _read(runtime, f, offset: int, view: torch.Tensor) -> None:
    if isinstance(f, _BufferedFile):
        data = os.pread(f.fd, view.numel(), offset)
        if len(data) != view.numel():
            raise OSError(5, f"checkpoint file {f.path} is truncated: wanted {view.numel()} bytes at offset "
                             f"{offset}, got {len(data)}", f.path)
        view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    else:
        runtime.engine.read(view, f, offset)


def _write(runtime, f, offset: int, view: torch.Tensor) -> None:
    if isinstance(f, _BufferedFile):
        os.pwrite(f.fd, view.numpy().tobytes(), offset)
    else:
        runtime.engine.write(view, f, offset)


def _close(runtime, f) -> None:
    if isinstance(f, _BufferedFile):
        f.close()
    else:
        runtime.engine.close(f)


def _scalar_to_json(value):
    if torch.is_tensor(value):
        return {"tensor": value.item(), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    raise TypeError(f"optimizer state scalar {value!r} cannot be saved")


def _scalar_from_json(value):
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def _hyperparameters(optimizer) -> List[Dict]:
    out = []
    for group in optimizer.param_groups:
        g = {}
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, (int, float, bool, str)) or v is None:
                g[k] = v
            elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v):
                g[k] = list(v)
        out.append(g)
    return out


def save(engine, runtime, save_dir: str, tag: Optional[str]) -> str:
    """Write this rank's swapped state under ``<save_dir>/<tag>/aidaptiv/rank<r>``; returns that folder."""
    tag = _resolve_tag(engine, save_dir, tag, saving=True)
    final = rank_dir(save_dir, tag, runtime.rank)
    tmp = final + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp, mode=0o700)
    ps, osw = runtime.param_swapper, runtime.optimizer_swapper
    osw.streamed_step.flush()  # updates deferred to the next forward belong to this checkpoint
    ps.cache.drain_writes()
    osw.drain()
    runtime.store.drain()
    mover = _Mover(runtime)
    try:
        # Parameters: the live part of the swap file, in its own layout (cached groups are written through).
        pf = mover.open(os.path.join(tmp, "params.bin"), create=True)
        try:
            mover.copy(runtime.params_file.handle, 0, pf, 0, runtime.params_file.allocated)
        finally:
            _close(runtime, pf)
        # Optimizer sub-groups: the chunk images (master and state slots), from host memory when resident.
        of = mover.open(os.path.join(tmp, "optim.bin"), create=True)
        groups = []
        offset = 0
        try:
            for sg in osw.by_index:
                nbytes = sg.region.reserved
                if sg.resident:
                    _write(runtime, of, offset, sg.image[:nbytes])
                else:
                    mover.copy(osw.file.handle, sg.region.offset, of, offset, nbytes)
                groups.append({"index": sg.index, "numel": sg.numel, "offset": offset, "bytes": nbytes,
                               "chunks": [c.numel for c in sg.chunks], "state_keys": sg.state_keys,
                               "state_valid": sg.state_valid,
                               "scalars": {k: _scalar_to_json(v) for k, v in sg.scalars.items()}})
                offset += nbytes
        finally:
            _close(runtime, of)
        manifest = {
            "format": FORMAT,
            "rank": runtime.rank,
            "model_dtype": str(runtime.model_dtype).replace("torch.", ""),
            "master_is_parameter": osw.master_is_parameter,
            "params_bytes": runtime.params_file.allocated,
            "records": [[r.ds_id, r.extent.offset, r.numel] for r in sorted(ps.records.values(),
                                                                            key=lambda r: r.ds_id)],
            "sub_groups": groups,
            "hyperparameters": _hyperparameters(osw.optimizer),
        }
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        del mover
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    log.info("aidaptiv: saved swapped state of rank %d to %s", runtime.rank, final)
    return final


def load(engine, runtime, load_dir: str, tag: Optional[str], load_optimizer_states: bool = True) -> None:
    """Restore this rank's swapped state from a checkpoint written by :func:`save`."""
    tag = _resolve_tag(engine, load_dir, tag, saving=False)
    folder = rank_dir(load_dir, tag, runtime.rank)
    manifest_path = os.path.join(folder, "manifest.json")
    if not os.path.exists(manifest_path):
        raise CheckpointMismatchError(
            f"checkpoint {os.path.join(load_dir, tag)} has no aidaptiv state for rank {runtime.rank} "
            f"({manifest_path} is missing): it was not saved by an aidaptiv run with this many ranks")
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    ps, osw = runtime.param_swapper, runtime.optimizer_swapper
    _check_compatible(manifest, runtime, ps, osw, folder)
    osw.streamed_step.discard_pending()  # the checkpoint replaces the state a pending update would have changed
    ps.cache.drain_writes()
    osw.drain()
    runtime.store.drain()
    ps.cache.drop_cache()
    mover = _Mover(runtime)
    try:
        pf = mover.open(os.path.join(folder, "params.bin"), create=False)
        try:
            saved = {ds_id: off for ds_id, off, _ in manifest["records"]}
            if all(saved[r.ds_id] == r.extent.offset for r in ps.records.values()):
                mover.copy(pf, 0, runtime.params_file.handle, 0, manifest["params_bytes"])
            else:  # same partitions, other layout (e.g. relocated groups): one partition at a time
                for r in ps.records.values():
                    mover.copy(pf, saved[r.ds_id], runtime.params_file.handle, r.extent.offset, r.extent.reserved)
        finally:
            _close(runtime, pf)
        ps.cache.drop_cache()  # again, now that the disk holds the loaded bytes: groups in use are re-read
        of = mover.open(os.path.join(folder, "optim.bin"), create=False)
        try:
            for entry, sg in zip(manifest["sub_groups"], osw.by_index):
                if sg.resident:
                    _read(runtime, of, entry["offset"], sg.image[:entry["bytes"]])
                else:
                    mover.copy(of, entry["offset"], osw.file.handle, sg.region.offset, entry["bytes"])
                if load_optimizer_states:
                    sg.state_keys = list(entry["state_keys"])
                    sg.state_valid = bool(entry["state_valid"])
                    sg.scalars = {k: _scalar_from_json(v) for k, v in entry["scalars"].items()}
                else:  # weights only: the moments start again from zero
                    sg.state_keys, sg.state_valid, sg.scalars = [], False, {}
                    if sg.resident:
                        for c in sg.chunks:
                            c.buffer[c.state_start:c.image_bytes].zero_()
                osw.gradients.reset(sg)
        finally:
            _close(runtime, of)
    finally:
        del mover
    if load_optimizer_states:
        for group, saved in zip(osw.optimizer.param_groups, manifest["hyperparameters"]):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    log.info("aidaptiv: restored swapped state of rank %d from %s", runtime.rank, folder)


def _check_compatible(manifest, runtime, ps, osw, folder) -> None:
    problems = []
    if manifest.get("format") != FORMAT:
        problems.append(f"format {manifest.get('format')} (this version reads {FORMAT})")
    dtype = str(runtime.model_dtype).replace("torch.", "")
    if manifest["model_dtype"] != dtype:
        problems.append(f"model dtype {manifest['model_dtype']} (this run: {dtype})")
    saved = {ds_id: numel for ds_id, _, numel in manifest["records"]}
    ours = {r.ds_id: r.numel for r in ps.records.values()}
    if saved != ours:
        problems.append(f"{len(saved)} parameter partitions (this run: {len(ours)}) or different sizes")
    if [(g["numel"], g["chunks"]) for g in manifest["sub_groups"]] != \
            [(sg.numel, [c.numel for c in sg.chunks]) for sg in osw.by_index]:
        problems.append(f"{len(manifest['sub_groups'])} optimizer sub-groups (this run: {len(osw.by_index)}) or "
                        "different sizes: keep aidaptiv.optimizer_chunk_numel and host_memory_budget as saved")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {folder} does not fit this run: " + "; ".join(problems) +
                                      ": resume with the model, world size and config it was saved with")
