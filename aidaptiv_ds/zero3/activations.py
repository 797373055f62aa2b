"""The activation policy (``aidaptiv.activations``) applied to the model a DeepSpeed engine trains.

:func:`apply_to_engine` runs at the end of :func:`aidaptiv_ds.zero3.initialize.initialize`, so our train
job, any ``deepspeed.initialize`` script and the Hugging Face Trainer (which calls ``deepspeed.initialize``)
all get it. By then the rank's runtime has its swap space, engine and host memory (the pinned pool is made
when the optimizer is built), which the ``nvme`` policy's store takes: its own file ``activations.swp`` in
the rank's swap folder (removed with the others at close), staging from the same host budget. What was done
and what the store measured join ``engine.aidaptiv_stats()`` under ``"activations"``.
"""
from __future__ import annotations

from aidaptiv_ds import activation_policy
from aidaptiv_ds.activation_store import ActivationStore

ACTIVATION_FILE = "activations.swp"


def apply_to_engine(engine, runtime, settings) -> dict:
    """Apply ``settings.activations`` to ``engine.module``; returns the plan (also in the stats)."""
    stores = []

    def make_store() -> ActivationStore:
        if runtime.memory is None:
            raise ValueError("aidaptiv.activations.policy \"nvme\" stages activations in the host budget, which "
                             "is set up when DeepSpeed builds the optimizer: configure an optimizer, or choose "
                             "\"recompute\"")
        file = runtime.space.create_file(ACTIVATION_FILE, runtime.engine)
        a = settings.activations
        store = ActivationStore(runtime.store, file, runtime.memory, read_ahead=a.read_ahead, min_bytes=a.min_bytes)
        stores.append(store)
        return store

    plan = activation_policy.apply(engine.module, settings.activations, make_store, rank=runtime.rank)
    stats = engine.aidaptiv_stats

    def aidaptiv_stats() -> dict:
        out = stats()
        out["activations"] = {**plan, **(stores[0].stats_dict() if stores else {})}
        return out

    engine.aidaptiv_stats = aidaptiv_stats
    return plan
