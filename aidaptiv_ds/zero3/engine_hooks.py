"""What the DeepSpeed engine gains when aidaptiv runs it: statistics, checkpoints of the swapped state,
and a clean close of the swap space.

- ``engine.aidaptiv_stats()``: this rank's cumulative counters (NVMe bytes, I/O wait, pinned memory, ...).
- ``engine.save_checkpoint`` / ``engine.load_checkpoint``: DeepSpeed's, plus every byte of the state that
  lives in our swap space (parameters, fp32 masters, optimizer moments and their step counts, optimizer
  hyperparameters), so that a resumed run continues the uninterrupted run's trajectory exactly.
- ``engine.destroy()``: DeepSpeed's, then the swap files are closed and removed (unless kept).
"""
from __future__ import annotations

import functools


def attach(engine, runtime) -> None:
    from aidaptiv_ds.zero3 import checkpoint

    engine.aidaptiv_runtime = runtime
    engine.aidaptiv_stats = runtime.stats_dict

    ds_save, ds_load, ds_destroy = engine.save_checkpoint, engine.load_checkpoint, engine.destroy

    @functools.wraps(ds_save)
    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        # Ours first: DeepSpeed's save ends by pointing "latest" at the new tag, which must only happen
        # once every byte of the state is on disk. A save past ulimit -f fails with EFBIG, not SIGXFSZ.
        with runtime.writing():
            checkpoint.save(engine, runtime, save_dir, tag)
            return ds_save(save_dir, tag=tag, client_state=client_state if client_state is not None else {},
                           save_latest=save_latest, **kwargs)

    @functools.wraps(ds_load)
    def load_checkpoint(load_dir, tag=None, **kwargs):
        load_path, client_state = ds_load(load_dir, tag=tag, **kwargs)
        if load_path is not None:
            checkpoint.load(engine, runtime, load_dir, tag,
                            load_optimizer_states=kwargs.get("load_optimizer_states", True)
                            and not kwargs.get("load_module_only", False))
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
