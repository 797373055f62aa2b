"""Checkpoints of the state that lives in our swap space, keyed by parameter name.

DeepSpeed 0.19 saves a ZeRO-3 run with the optimizer on NVMe by copying the swapper's folder, and on load
copies it back and skips the optimizer's state dict: Adam restarts from zero state and the learning rate
reads 0, so a resumed run drifts from the uninterrupted one. Ours adds, next to DeepSpeed's files, a folder
per rank with every byte the resumed run needs (``<save_dir>/<tag>/aidaptiv/rank<r>/``: params.bin, optim.bin
and manifest.json, laid out as :mod:`aidaptiv_ds.swap.checkpoint_format` describes); this module writes and
loads it, which needs the running engine.

Nothing refers to DeepSpeed's process-wide parameter ids, so a second model built in the same process (HF
``resume_from_checkpoint``, notebooks, hyper-parameter search) loads it. The load re-chunks: when this run's
sub-groups and chunks (which follow ``host_memory_budget`` and ``optimizer_chunk_numel``) or its parameter
layout differ from the saved ones, each chunk image is assembled from the saved pieces of its parameters;
when they match, the files are copied back whole. Either way data moves through one bounded buffer at a
time, never the whole state at once. The world size (each rank's partition of each parameter) and the model
dtype must be the ones saved; other world sizes are refused with a clear message.

Durability is the caller's (:mod:`aidaptiv_ds.zero3.engine_hooks` with :mod:`aidaptiv_ds.common.durable`): the
folder is written inside a staging tag, fsync'd here, and published with the rest of the checkpoint by one
rename. Data moves through the pinned pool with the engine (O_DIRECT where the checkpoint filesystem allows
it); re-chunking reads pieces that are not 4 KiB aligned through the page cache.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional

import torch

from aidaptiv_ds.common import durable
from aidaptiv_ds.swap import checkpoint_format
from aidaptiv_ds.swap.checkpoint_format import (
    BASE,
    FORMAT,
    MANIFEST,
    OPTIM,
    PARAMS,
    CheckpointMismatchError,
    rank_dir,
    resolve_tag,
)
from aidaptiv_ds.swap.checkpoint_verify import ALGORITHM, inspectors
from aidaptiv_ds.zero3.checkpoint_transfer import Mover, close_file, pread_into, read_into, write_from

log = logging.getLogger(__name__)


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


def _named(module, records) -> Dict[int, tuple]:
    out = {}
    for name, p in module.named_parameters():
        ds_id = getattr(p, "ds_id", None)
        if ds_id in records and ds_id not in out:
            shape = getattr(p, "ds_shape", None) or p.shape
            out[ds_id] = (name, [int(x) for x in shape])
    return out


def save_problem(module, records) -> Optional[str]:
    """Why this rank's swapped state could not be saved by name (None when it can): partitions that belong
    to no parameter of ``module``. Asked once the engine is built, so that a run learns it before its first
    step rather than at its first checkpoint. (A tied head's replaced weight is not one of them: the
    parameter swapper gives its space back when the optimizer is set up.)"""
    missing = [i for i in records if i not in _named(module, records)]
    if not missing:
        return None
    return (
        f"{len(missing)} parameter partitions of this rank's swap space belong to no parameter of the model "
        "DeepSpeed wraps, so no checkpoint of this run can be saved: build one model per zero.Init / "
        "deepspeed.initialize, and pass deepspeed.initialize the whole model built under it"
    )


def parameter_names(module, records) -> Dict[int, tuple]:
    """ds_id -> (name, shape) of every partition in ``records``, named as ``module.named_parameters()``
    names them (a tied parameter by its first name)."""
    problem = save_problem(module, records)
    if problem:
        raise CheckpointMismatchError(problem)
    return _named(module, records)


def _layout(osw, names) -> List[dict]:
    """The sub-groups as pieces of named parameters (offsets of chunk images relative to optim.bin)."""
    groups, base = [], 0
    for sg in osw.by_index:
        chunks = []
        for c in sg.chunks:
            chunks.append(
                {
                    "offset": base + c.offset - sg.region.offset,
                    "numel": c.numel,
                    "part": c.part,
                    "pieces": [[names[p.record.ds_id][0], p.start, p.numel, p.flat] for p in c.pieces],
                }
            )
        groups.append(
            {
                "numel": sg.numel,
                "offset": base,
                "bytes": sg.region.reserved,
                "chunks": chunks,
                "members": [names[rec.ds_id][0] for rec, _, _ in sg.members],
            }
        )
        base += sg.region.reserved
    return groups


def save(engine, runtime, save_dir: str, tag: str) -> str:
    """Write this rank's swapped state under ``<save_dir>/<tag>/aidaptiv/rank<r>`` (fsync'd); returns that
    folder. ``tag`` is the staging tag the caller publishes once every file of the checkpoint is written."""
    folder = rank_dir(save_dir, tag, runtime.rank)
    os.makedirs(folder, mode=0o700)
    ps, osw = runtime.param_swapper, runtime.optimizer_swapper
    names = parameter_names(engine.module, ps.records)
    osw.streamed_step.flush()  # updates deferred to the next forward belong to this checkpoint
    ps.cache.drain_writes()
    osw.drain()
    runtime.store.drain()
    sub_groups = _layout(osw, names)
    for sg, entry in zip(osw.by_index, sub_groups):
        entry.update(
            state_keys=sg.state_keys,
            state_valid=sg.state_valid,
            scalars={k: _scalar_to_json(v) for k, v in sg.scalars.items()},
        )
    # Which parameters hold numbers: a QLoRA base is bitsandbytes' packed 4-bit data stored in the model dtype,
    # whose bytes read as that dtype are arbitrary (some are NaN), so only the finite check skips it.
    packed = {name for name, p in engine.module.named_parameters() if getattr(p, "quant_state", None) is not None}
    # A frozen base (LoRA, QLoRA) goes to base.bin, the trained parameters to params.bin (see _write_params).
    frozen = {name for name, p in engine.module.named_parameters() if not p.requires_grad}
    parameters = []
    for rec in sorted(ps.records.values(), key=lambda r: r.extent.offset):
        name, shape = names[rec.ds_id]
        entry = {"name": name, "shape": shape, "partition_numel": rec.numel, "offset": rec.extent.offset}
        if name in packed:
            entry["values"] = False
        if name in frozen:
            entry["file"] = BASE
        parameters.append(entry)
    manifest = {
        "format": FORMAT,
        "rank": runtime.rank,
        "world_size": _world_size(),
        "model_dtype": str(runtime.model_dtype).replace("torch.", ""),
        "master_is_parameter": osw.master_is_parameter,
        "params_bytes": runtime.params_file.allocated,
        "optim_bytes": sum(g["bytes"] for g in sub_groups),
        "parameters": parameters,
        "sub_groups": sub_groups,
        "hyperparameters": _hyperparameters(osw.optimizer),
    }
    if frozen & {p["name"] for p in parameters}:
        manifest["base_bytes"] = runtime.params_file.allocated
    # Every block is checksummed on its way out, and parameters and optimizer state must be finite: a run
    # whose weights went NaN fails here instead of publishing them as the checkpoint to resume from.
    seen = inspectors(folder, manifest)
    mover = Mover(runtime)
    try:
        # Parameters: the live part of the swap file, in its own layout (cached groups are written through).
        if "base_bytes" in manifest:
            _write_params(runtime, mover, folder, manifest, seen, save_dir)
        else:
            pf = mover.open(os.path.join(folder, PARAMS), create=True)
            durable.crash_point("params.bin created")
            try:
                mover.copy(runtime.params_file.handle, 0, pf, 0, runtime.params_file.allocated, seen[PARAMS].see)
            finally:
                close_file(runtime, pf)
        durable.crash_point("params.bin written")
        # Optimizer sub-groups: the chunk images (master and state slots), from host memory when resident.
        of = mover.open(os.path.join(folder, OPTIM), create=True)
        durable.crash_point("optim.bin created")
        try:
            for sg, entry in zip(osw.by_index, sub_groups):
                offset = entry["offset"]
                if sg.resident:
                    image = sg.image[: sg.region.reserved]
                    seen[OPTIM].see(offset, image)
                    write_from(runtime, of, offset, image)
                    durable.crash_point(f"resident sub-group {sg.index} written")
                else:
                    mover.copy(osw.file.handle, sg.region.offset, of, offset, sg.region.reserved, seen[OPTIM].see)
        finally:
            close_file(runtime, of)
        durable.crash_point("optim.bin written")
        manifest["checksums"] = {"algorithm": ALGORITHM, **{name: insp.blocks for name, insp in seen.items()}}
        with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f)
        durable.crash_point("manifest written")
        durable.fsync_tree(folder)
        durable.fsync_path(os.path.dirname(folder))
    finally:
        del mover
    log.info("aidaptiv: saved swapped state of rank %d to %s", runtime.rank, folder)
    return folder


def _write_params(runtime, mover, folder: str, manifest: dict, seen: dict, save_dir: str) -> None:
    """A run with a frozen base: params.bin holds the trained parameters' partitions and base.bin the frozen
    ones, each at its swap-file offset (sparse files: the other file's extents are holes, said as such in the
    checksums), so a LoRA checkpoint writes its adapters, not its base again. A frozen weight never changes, so
    base.bin is the same file from one checkpoint of the run to the next: hard-linked from the newest checkpoint
    in ``save_dir`` whose base has the same partitions and checksums as the one this run holds (written or
    loaded by it), else written; the disk holds one base however many checkpoints are kept."""
    # the manifest lists the partitions in the order of their offsets: the records sorted alike pair with them
    entries = sorted(manifest["parameters"], key=lambda p: p["offset"])
    records = sorted(runtime.param_swapper.records.values(), key=lambda r: r.extent.offset)
    end = runtime.params_file.allocated
    key = [(p["name"], p["offset"]) for p in entries if p.get("file") == BASE]
    for name, target in ((PARAMS, None), (BASE, BASE)):
        path = os.path.join(folder, name)
        if target == BASE and _link_base(runtime, save_dir, path, key, seen[BASE]):
            continue
        f = mover.open(path, create=True)
        try:
            at = 0
            for entry, rec in zip(entries, records):
                if entry.get("file") != target:
                    continue
                seen[name].hole(at, rec.extent.offset - at)
                mover.copy(runtime.params_file.handle, rec.extent.offset, f, rec.extent.offset, rec.extent.reserved,
                           seen[name].see)  # fmt: skip
                at = rec.extent.offset + rec.extent.reserved
            seen[name].hole(at, end - at)
        finally:
            close_file(runtime, f)
        os.truncate(path, end)  # the manifest's size; the tail is a hole
        if target == BASE:
            runtime.base_saved = (key, [list(b) for b in seen[BASE].blocks])


def _link_base(runtime, save_dir: str, path: str, key, inspector) -> bool:
    """Hard-link ``path`` to the base.bin of the newest checkpoint in ``save_dir`` that holds the base this run
    holds (same partitions, same checksums); False when there is none (or linking is refused: write it)."""
    held = getattr(runtime, "base_saved", None)
    if held is None or held[0] != key:
        return False
    tag = resolve_tag(save_dir, None)
    if tag is None:
        return False
    other = rank_dir(save_dir, tag, runtime.rank)
    try:
        with open(os.path.join(other, MANIFEST), encoding="utf-8") as f:
            theirs = json.load(f)
        blocks = (theirs.get("checksums") or {}).get(BASE)
        if (
            blocks != held[1]
            or [(p["name"], p["offset"]) for p in theirs["parameters"] if p.get("file") == BASE] != key
        ):
            return False
        os.link(os.path.join(other, BASE), path)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    inspector.seen(blocks)
    return True


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def read_manifest(load_dir: str, tag: str, rank: int) -> tuple:
    """(folder, manifest) of this rank's state in a checkpoint, refusing what this version cannot load into this
    run (:func:`aidaptiv_ds.swap.checkpoint_format.read_manifest` with this run's world size)."""
    return checkpoint_format.read_manifest(load_dir, tag, rank, _world_size())


def load(engine, runtime, load_dir: str, tag: Optional[str], load_optimizer_states: bool = True) -> None:
    """Restore this rank's swapped state from a checkpoint written by :func:`save`, re-chunked to this
    run's sub-groups and chunks where they differ."""
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        raise CheckpointMismatchError(f"{load_dir} has no 'latest' file: name the tag to load")
    folder, manifest = read_manifest(load_dir, tag, runtime.rank)
    ps, osw = runtime.param_swapper, runtime.optimizer_swapper
    names = parameter_names(engine.module, ps.records)
    saved_params = _check_compatible(manifest, runtime, ps, osw, names, folder)
    osw.streamed_step.discard_pending()  # the checkpoint replaces the state a pending update would have changed
    ps.cache.drain_writes()
    osw.drain()
    runtime.store.drain()
    ps.cache.drop_cache()
    layout = _layout(osw, names)
    same = [[(c["numel"], c["pieces"]) for c in g["chunks"]] for g in layout] == [
        [(c["numel"], c["pieces"]) for c in g["chunks"]] for g in manifest["sub_groups"]
    ]
    mover = Mover(runtime)
    try:
        _load_params(runtime, ps, mover, folder, manifest, saved_params, names)
        ps.cache.drop_cache()  # again, now that the disk holds the loaded bytes: groups in use are re-read
        if same:
            _load_images(runtime, osw, mover, folder, manifest)
    finally:
        del mover
    if not same:  # after the transfer buffer is gone: chunk images need the room
        _rechunk_images(runtime, osw, folder, manifest, names)
        log.info(
            "aidaptiv: re-chunked optimizer state of %s (%d saved sub-groups, %d now)",
            folder,
            len(manifest["sub_groups"]),
            len(osw.by_index),
        )
    _restore_step_state(osw, manifest, names, load_optimizer_states)
    if load_optimizer_states:
        for group, saved in zip(osw.optimizer.param_groups, manifest["hyperparameters"]):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    log.info("aidaptiv: restored swapped state of rank %d from %s", runtime.rank, folder)


def _load_params(runtime, ps, mover, folder, manifest, saved_params, names) -> None:
    if "base_bytes" in manifest:  # a frozen base in base.bin: each partition from its file
        files = {PARAMS: mover.open(os.path.join(folder, PARAMS), create=False)}
        try:
            files[BASE] = mover.open(os.path.join(folder, BASE), create=False)
            for r in ps.records.values():
                saved = saved_params[names[r.ds_id][0]]
                mover.copy(files[saved.get("file", PARAMS)], saved["offset"], runtime.params_file.handle,
                           r.extent.offset, r.extent.reserved)  # fmt: skip
        finally:
            for f in files.values():
                close_file(runtime, f)
        base = [(p["name"], p["offset"]) for p in manifest["parameters"] if p.get("file") == BASE]
        # the next save links this base.bin when the layout is the same (the swap file holds its bytes now)
        same = all(saved_params[names[r.ds_id][0]]["offset"] == r.extent.offset for r in ps.records.values())
        blocks = (manifest.get("checksums") or {}).get(BASE)
        runtime.base_saved = (base, blocks) if same and blocks else None
        return
    pf = mover.open(os.path.join(folder, PARAMS), create=False)
    try:
        if (
            all(saved_params[names[r.ds_id][0]]["offset"] == r.extent.offset for r in ps.records.values())
            and manifest["params_bytes"] <= runtime.params_file.allocated
        ):
            mover.copy(pf, 0, runtime.params_file.handle, 0, manifest["params_bytes"])
        else:  # same partitions, other layout (other layer groups, another model built first): one at a time
            for r in ps.records.values():
                mover.copy(
                    pf,
                    saved_params[names[r.ds_id][0]]["offset"],
                    runtime.params_file.handle,
                    r.extent.offset,
                    r.extent.reserved,
                )
    finally:
        close_file(runtime, pf)


def _load_images(runtime, osw, mover, folder, manifest) -> None:
    """Same sub-groups and chunks as saved: each sub-group's images back in one copy."""
    of = mover.open(os.path.join(folder, OPTIM), create=False)
    try:
        for sg, saved in zip(osw.by_index, manifest["sub_groups"]):
            src = saved["offset"]
            if sg.resident:
                read_into(runtime, of, src, sg.image[: saved["bytes"]])
            else:
                mover.copy(of, src, osw.file.handle, sg.region.offset, saved["bytes"])
    finally:
        close_file(runtime, of)


def _rechunk_images(runtime, osw, folder, manifest, names) -> None:
    """Other sub-groups or chunks than saved: assemble each chunk image of this run from the saved pieces
    of its parameters, one chunk at a time, and write it to the optimizer swap file (or the resident
    image). Every part (master, state slots) of a piece is at the same element offset in its chunk's part."""
    saved_pieces: Dict[str, list] = {}
    for g in manifest["sub_groups"]:
        for c in g["chunks"]:
            for name, start, numel, flat in c["pieces"]:
                saved_pieces.setdefault(name, []).append((start, numel, c["offset"], c["part"], flat))
    path = os.path.join(folder, OPTIM)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for sg in osw.by_index:
            for c in sg.chunks:
                buf = c.buffer if sg.resident else runtime.memory.take(c.image_bytes, "re-chunked optimizer state")
                buf[: c.image_bytes].zero_()
                for p in c.pieces:
                    name = names[p.record.ds_id][0]
                    for start, numel, off, part, flat in saved_pieces[name]:
                        lo, hi = max(p.start, start), min(p.start + p.numel, start + numel)
                        if lo >= hi:
                            continue
                        for k in range(c.parts):
                            src = off + k * part + (flat + lo - start) * 4
                            dst = k * c.part + (p.flat + lo - p.start) * 4
                            pread_into(fd, path, src, buf[dst : dst + (hi - lo) * 4])
                if not sg.resident:
                    runtime.engine.write(buf[: c.image_bytes], osw.file.handle, c.offset)
                    del buf
    finally:
        os.close(fd)


def _restore_step_state(osw, manifest, names, load_optimizer_states) -> None:
    """Each sub-group's state keys, whether its slots hold values, and its scalars (Adam's step count):
    those of the saved sub-groups that held its parameters, which must agree."""
    by_name = {}
    for g in manifest["sub_groups"]:
        for name in g["members"]:
            by_name[name] = g
    for sg in osw.by_index:
        if load_optimizer_states:
            sources = {id(by_name[names[rec.ds_id][0]]): by_name[names[rec.ds_id][0]] for rec, _, _ in sg.members}
            states = {
                json.dumps([g["state_keys"], g["state_valid"], g["scalars"]], sort_keys=True) for g in sources.values()
            }
            if len(states) > 1:
                raise CheckpointMismatchError(
                    f"optimizer sub-group {sg.index} of this run gathers parameters whose saved optimizer state "
                    f"differs in its step count or keys ({len(states)} variants): this checkpoint cannot be "
                    "re-chunked; resume with the optimizer_chunk_numel and host_memory_budget it was saved with"
                )
            g = next(iter(sources.values()))
            sg.state_keys = list(g["state_keys"])
            sg.state_valid = bool(g["state_valid"])
            sg.scalars = {k: _scalar_from_json(v) for k, v in g["scalars"].items()}
        else:  # weights only: the moments start again from zero
            sg.state_keys, sg.state_valid, sg.scalars = [], False, {}
            if sg.resident:
                for c in sg.chunks:
                    c.buffer[c.state_start : c.image_bytes].zero_()
        osw.gradients.reset(sg)


def check_fits_this_run(engine, runtime, folder: str, manifest: dict) -> None:
    """Refuse, in one sentence, a checkpoint of another model, dtype or partitioning before DeepSpeed loads
    its module state (whose own refusal is a wall of missing and unexpected keys)."""
    ps = runtime.param_swapper
    _check_compatible(
        manifest, runtime, ps, runtime.optimizer_swapper, parameter_names(engine.module, ps.records), folder
    )


def _check_compatible(manifest, runtime, ps, osw, names, folder) -> Dict[str, dict]:
    """Saved parameters by name, once they are known to fit this run."""
    problems = []
    dtype = str(runtime.model_dtype).replace("torch.", "")
    if manifest["model_dtype"] != dtype:
        problems.append(f"model dtype {manifest['model_dtype']} (this run: {dtype})")
    saved = {p["name"]: p for p in manifest["parameters"]}
    ours = {names[r.ds_id][0]: (names[r.ds_id][1], r.numel) for r in ps.records.values()}
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    if missing:
        problems.append(f"{len(missing)} parameters of this model are not in it (e.g. {', '.join(missing[:3])})")
    if extra:
        problems.append(f"{len(extra)} saved parameters are not in this model (e.g. {', '.join(extra[:3])})")
    other = [
        n
        for n in sorted(set(ours) & set(saved))
        if (saved[n]["shape"], saved[n]["partition_numel"]) != (ours[n][0], ours[n][1])
    ]
    if other:
        n = other[0]
        problems.append(
            f"{len(other)} parameters have another shape or partition (e.g. {n}: saved "
            f"{saved[n]['shape']} / {saved[n]['partition_numel']}, this run {ours[n][0]} / {ours[n][1]})"
        )
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {folder} does not fit this run: "
            + "; ".join(problems)
            + ": resume with the model, dtype and world size it was saved with"
        )
    return saved
