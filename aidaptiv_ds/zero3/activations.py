"""The activation policy (``aidaptiv.activations``) applied to the model a DeepSpeed engine trains.

:func:`apply_to_engine` runs at the end of :func:`aidaptiv_ds.zero3.initialize.initialize`, so our train
job, any ``deepspeed.initialize`` script and the Hugging Face Trainer (which calls ``deepspeed.initialize``)
all get it. By then the rank's runtime has its swap space, engine and host memory (the pinned pool is made
when the optimizer is built), which the ``nvme`` and ``auto`` policies' store takes: its own file
``activations.swp`` in the rank's swap folder (removed with the others at close), staging from the same
host budget. The ``auto`` plan weighs the swap disk's bandwidth (:func:`nvme_bandwidth`) and, on CPU, takes
the rank's host budget as its default activation budget. What was done, auto's plan and what the store
measured join ``engine.aidaptiv_stats()`` under ``"activations"``.
"""

from __future__ import annotations

import time

from aidaptiv_ds.activations import policy as activation_policy
from aidaptiv_ds.activations.store import ActivationStore
from aidaptiv_ds.common.sizes import ALIGN, MiB
from aidaptiv_ds.swap.host_memory import aligned_empty

ACTIVATION_FILE = "activations.swp"
# The bandwidth probe of the auto plan when the rates cache has none for the disk: small enough to be quick
# and to fit a small host budget, large enough to be a few long requests.
PROBE_BYTES = 16 * MiB


def nvme_bandwidth(runtime, store: ActivationStore):
    """(read, write) bytes/s of the swap disk and where they come from: the rates ``aidaptiv-ds plan --nvme-path``
    cached for this disk, or else a write and read-back of up to :data:`PROBE_BYTES` through this rank's
    engine into the activation file (O_DIRECT, so the disk's, not the page cache's)."""
    from aidaptiv_ds.engine.machine_cache import disk_key, load_cache

    try:
        entry = load_cache().get(disk_key(runtime.cfg.nvme_path)) or {}
    except OSError:
        entry = {}
    if entry.get("nvme_read") and entry.get("nvme_write"):
        return (
            float(entry["nvme_read"]),
            float(entry["nvme_write"]),
            f"the rates cache ({entry.get('when', 'measured')})",
        )
    nbytes = max(ALIGN, min(PROBE_BYTES, runtime.memory.capacity // 8) // ALIGN * ALIGN)
    # From the pool when it has room (back to it when dropped); a budget the job already fills (a small one,
    # or every slot taken) must not fail the job over a one-off measurement: then an ordinary aligned buffer,
    # a few MiB for the moment of the probe.
    buf = runtime.memory.try_take(nbytes)
    if buf is None:
        buf = aligned_empty(nbytes)
    extent = store.file.allocate(nbytes)
    try:
        t0 = time.perf_counter()
        runtime.store.write_span(store.file, extent.offset, buf, "activation probe").wait()
        t1 = time.perf_counter()
        runtime.store.read_span(store.file, extent.offset, buf, "activation probe").wait()
        t2 = time.perf_counter()
    finally:
        store.file.release(extent)
        del buf
    return nbytes / (t2 - t1), nbytes / (t1 - t0), f"measured now: {nbytes / MiB:.0f} MiB written and read back"


def apply_to_engine(engine, runtime, settings) -> dict:
    """Apply ``settings.activations`` to ``engine.module``; returns the plan (also in the stats)."""
    stores = []

    def make_store() -> ActivationStore:
        if runtime.memory is None:
            raise ValueError(
                f'aidaptiv.activations.policy "{settings.activations.policy}" stages activations '
                "in the host budget, which is set up when DeepSpeed builds the optimizer: configure "
                'an optimizer, or choose "recompute"'
            )
        file = runtime.space.create_file(ACTIVATION_FILE, runtime.engine)
        a = settings.activations
        store = ActivationStore(runtime.store, file, runtime.memory, read_ahead=a.read_ahead, min_bytes=a.min_bytes)
        stores.append(store)
        return store

    plan = activation_policy.apply(
        engine.module,
        settings.activations,
        make_store,
        rank=runtime.rank,
        bandwidth=lambda: nvme_bandwidth(runtime, stores[0]),
        host_budget=settings.host_budget_bytes,
    )
    stats = engine.aidaptiv_stats

    def aidaptiv_stats() -> dict:
        out = stats()
        auto = activation_policy.auto_plan(engine.module)
        stored = stores[0].stats_dict() if stores else {}
        if auto is not None:
            # The micro-step whose forward measured stored nothing and so waited for nothing: its entry keeps
            # the waits aligned with the steps (the metrics take one per micro-step, warm-up first).
            stored["io_wait_s_cycles"] = [0.0] + stored["io_wait_s_cycles"]
            stored["plan"] = auto
        out["activations"] = {**plan, **stored}
        return out

    engine.aidaptiv_stats = aidaptiv_stats
    return plan
