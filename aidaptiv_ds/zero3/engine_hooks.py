"""What the DeepSpeed engine gains when aidaptiv runs it: statistics, checkpoints of the swapped state,
and a clean close of the swap space.

- ``engine.aidaptiv_stats()``: this rank's cumulative counters (NVMe bytes, I/O wait, pinned memory, ...).
- ``engine.aidaptiv_save_problem()``: None, or why no checkpoint of this engine can be saved (said at
  ``initialize`` as a warning too, so that a script learns it before training, not at its first save).
- ``engine.save_checkpoint`` / ``engine.load_checkpoint``: DeepSpeed's, plus every byte of the state that
  lives in our swap space (parameters, fp32 masters, optimizer moments and their step counts, optimizer
  hyperparameters, keyed by parameter name), so that a resumed run continues the uninterrupted run's
  trajectory exactly. A save is durable and atomic: everything (ours and DeepSpeed's files) is written into
  a staging tag, fsync'd, and published by one rename or folder exchange, then ``latest`` is replaced
  atomically by us rather than rewritten in place by DeepSpeed (:mod:`aidaptiv_ds.common.durable`). A load
  verifies the tag first and unpickles every file as data only; the save dir gets, in place of DeepSpeed's
  zero_to_fp32.py and zero_to_torch.py, scripts that point to ``aidaptiv-ds export``.
- ``engine.destroy()``: DeepSpeed's, then the swap files are closed and removed (unless kept).
"""

from __future__ import annotations

import functools
import os

from deepspeed import comm as dist


def attach(engine, runtime) -> None:
    from aidaptiv_ds.common import durable
    from aidaptiv_ds.swap import checkpoint_format, checkpoint_verify
    from aidaptiv_ds.zero3 import checkpoint, checkpoint_trust, compat

    engine.aidaptiv_runtime = runtime
    engine.aidaptiv_stats = runtime.stats_dict
    # None, or why no checkpoint of this engine could be saved: asked by a job before its first step.
    engine.aidaptiv_save_problem = lambda: checkpoint.save_problem(engine.module, runtime.param_swapper.records)

    ds_save, ds_load, ds_destroy = engine.save_checkpoint, engine.load_checkpoint, engine.destroy

    @functools.wraps(ds_save)
    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        if compat.checkpoint_engine_is_decoupled(engine):
            raise ValueError(
                "aidaptiv publishes a checkpoint once all its files are written, which a decoupled "
                "(asynchronous) DeepSpeed checkpoint engine does not allow: remove the "
                '"checkpoint" engine setting that selects it'
            )
        tag = str(tag) if tag is not None else compat.default_checkpoint_tag(engine)
        committer = compat.checkpoint_writer_rank(engine) == 0
        if committer:
            durable.begin(save_dir, tag)
        dist.barrier()
        staging = durable.staging_name(tag)
        # Ours first, then DeepSpeed's files, all into the staging tag; DeepSpeed must not write "latest"
        # (it rewrites it in place): it is replaced atomically once the tag's folder is in place. A save past
        # ulimit -f fails with EFBIG, not SIGXFSZ.
        with runtime.writing():
            problem = None
            try:
                checkpoint.save(engine, runtime, save_dir, staging)
            except checkpoint_format.CheckpointDamagedError as e:  # non-finite state: nothing is published
                problem = e
            # Every rank stops together (the others would wait for it in DeepSpeed's save otherwise).
            if compat.worst_on_any_rank(engine, int(problem is not None)):
                raise problem or checkpoint_format.CheckpointDamagedError(
                    f"not saved: another rank's state holds a non-finite value (its message says where); the "
                    f"last checkpoint in {save_dir} stays the one to resume from"
                )
            # DeepSpeed's zero_to_fp32.py cannot convert this checkpoint and unpickles whatever its folder holds:
            # the save dir gets a script that says what to run instead (see checkpoint_trust.RECOVERY_POINTER).
            with (
                compat.checkpoint_file_hooks(engine, durable.crash_point, durable.hooks_active()),
                compat.recovery_scripts_replaced(engine, checkpoint_trust.write_recovery_pointers),
            ):
                ds_save(
                    save_dir,
                    tag=staging,
                    client_state=client_state if client_state is not None else {},
                    save_latest=False,
                    **kwargs,
                )  # returns once every rank has written its files
        if committer:
            # DeepSpeed's files get their checksums before the tag is published (ours are in the manifests).
            checkpoint_verify.write_tag_checksums(os.path.join(save_dir, staging))
            durable.publish(save_dir, tag, save_latest)
        dist.barrier()
        return True

    @functools.wraps(ds_load)
    def load_checkpoint(load_dir, tag=None, **kwargs):
        resolved = checkpoint_format.resolve_tag(load_dir, tag)
        problem = None
        if resolved is not None:
            durable.recover(load_dir, resolved)
            if os.path.isdir(os.path.join(load_dir, resolved)):  # (a missing one: DeepSpeed returns None)
                # Refuse a checkpoint this version cannot load, or one that is not what its save wrote, before
                # DeepSpeed changes anything.
                try:
                    folder, manifest = checkpoint.read_manifest(load_dir, resolved, runtime.rank)
                    checkpoint_verify.verify_tag(os.path.join(load_dir, resolved), folder, manifest)
                    checkpoint_trust.check_pickles_are_data(os.path.join(load_dir, resolved))
                    checkpoint.check_fits_this_run(engine, runtime, folder, manifest)
                except checkpoint_format.CheckpointMismatchError as e:
                    problem = e
        # Every rank loads the tag or none does, and refuses it alike (damaged: 2, which --resume auto skips on
        # all ranks together; another mismatch: 1), whichever rank found the problem in its own files.
        kind = 2 if isinstance(problem, checkpoint_format.CheckpointDamagedError) else int(problem is not None)
        worst = compat.worst_on_any_rank(engine, kind)
        if worst:
            if problem is not None and (worst == 2) == isinstance(problem, checkpoint_format.CheckpointDamagedError):
                raise problem
            cls = checkpoint_format.CheckpointDamagedError if worst == 2 else checkpoint_format.CheckpointMismatchError
            raise cls(
                f"checkpoint {os.path.join(load_dir, str(resolved))} was refused by another rank (its message says "
                "why): resume from another checkpoint (--resume auto takes the newest one that verifies)"
            )
        # Every file DeepSpeed unpickles is loaded as data only, as the check above loaded every pickle of the tag:
        # a planted object is refused, not run, also when the file changed between the two.
        with compat.checkpoint_loads_as_data(engine, checkpoint_trust.refused_file):
            load_path, client_state = ds_load(load_dir, tag=tag, **kwargs)
        if load_path is not None:
            checkpoint.load(
                engine,
                runtime,
                load_dir,
                resolved,
                load_optimizer_states=kwargs.get("load_optimizer_states", True)
                and not kwargs.get("load_module_only", False),
            )
        return load_path, client_state

    @functools.wraps(ds_destroy)
    def destroy(*args, **kwargs):
        try:
            return ds_destroy(*args, **kwargs)
        finally:
            runtime.close()

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    engine.destroy = destroy
