"""Activations stored on NVMe (aidaptiv_ds.activations.store, applied by aidaptiv_ds.activations.policy) with the
real engine: the same loss and gradients as keeping them, the backward reads them back in reverse with
read-ahead, no staging is left over, the file is reused step after step, and I/O errors end the step with a
clear error."""

import errno
import json

import pytest
import torch
from engine_helpers import run_child

from aidaptiv_ds.activations import policy as activation_policy
from aidaptiv_ds.activations.store import ActivationStore
from aidaptiv_ds.config.settings import ActivationSettings
from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.swap.host_memory import HostMemory
from aidaptiv_ds.swap.space import SwapSpace
from aidaptiv_ds.swap.store import SwapStore

LAYERS, SEQ = 4, 96


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=97,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def batch(seed=1):
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def loss_and_grads(model, steps=1):
    out = []
    for s in range(steps):
        model.zero_grad()
        loss = model(**batch(s)).loss
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


class Rig:
    def __init__(self, tmp_path, backend, pool_bytes=32 << 20):
        self.pool = PinnedPool(pool_bytes)
        self.engine = IOEngine(backend=backend, pool=self.pool)
        self.space = SwapSpace(str(tmp_path), rank=0)
        self.store = SwapStore(self.engine, self.space)
        self.memory = HostMemory(self.pool)
        self.file = self.space.create_file("activations.swp", self.engine)

    def activation_store(self, **kw):
        return ActivationStore(self.store, self.file, self.memory, **{"min_bytes": 1024, **kw})

    def close(self):
        self.store.drain()
        self.space.close()
        self.engine.shutdown()


@pytest.fixture
def rig(tmp_path, backend):
    r = Rig(tmp_path, backend)
    yield r
    r.close()


@pytest.mark.parametrize("policy", ["recompute", "nvme"])
def test_same_losses_and_gradients_as_keeping_activations(rig, policy):
    reference = loss_and_grads(tiny_llama(), steps=3)
    model = tiny_llama()
    stores = []
    plan = activation_policy.apply(
        model,
        ActivationSettings(policy=policy, loss_chunk_tokens=0),
        lambda: stores.append(rig.activation_store()) or stores[-1],
    )
    model.train()
    ours = loss_and_grads(model, steps=3)
    assert plan["recompute"] and plan["stored"] == (policy == "nvme")
    for (loss, grads), (ref_loss, ref_grads) in zip(ours, reference):
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
        for n, g in grads.items():
            assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-7), n
    if policy == "nvme":
        s = stores[0].stats_dict()
        # Each block's input at least (the checkpoints keep nothing else of a block), every byte read back.
        assert s["tensors_stored"] >= 3 * LAYERS and s["bytes_read"] >= s["bytes_stored"] > 0
        assert s["cycles"] == 3 and s["reads_ahead"] > 0
        assert stores[0].staging_bytes() == 0 and rig.pool.stats()["in_use"] == 0


def test_tensors_larger_than_a_piece_move_in_pieces(rig, monkeypatch):
    """A stored tensor goes through staging in pieces (PIECE_BYTES, 8 MiB; 16 KiB here, so each 48 KiB block
    input takes three and the last is short): same losses and gradients, every byte back, no staging left."""
    from aidaptiv_ds.activations import store as activation_store

    monkeypatch.setattr(activation_store, "PIECE_BYTES", 16 << 10)
    reference = loss_and_grads(tiny_llama(), steps=2)
    model = tiny_llama()
    store = rig.activation_store(read_ahead=2)
    activation_policy.apply(model, ActivationSettings(policy="nvme", loss_chunk_tokens=0), lambda: store)
    model.train()
    ours = loss_and_grads(model, steps=2)
    for (loss, grads), (ref_loss, ref_grads) in zip(ours, reference):
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
        for n, g in grads.items():
            assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-7), n
    s = store.stats_dict()
    assert s["bytes_stored"] >= 2 * LAYERS * 2 * SEQ * 64 * 4 and s["bytes_read"] >= s["bytes_stored"]
    assert store.staging_bytes() == 0 and rig.pool.stats()["in_use"] == 0


def test_backward_reads_in_reverse_ahead_of_need_and_the_file_is_reused(rig):
    model = tiny_llama()
    store = rig.activation_store(read_ahead=2)
    activation_policy.apply(model, ActivationSettings(policy="nvme", loss_chunk_tokens=16), lambda: store)
    model.train()
    order = []
    unpack = store.unpack

    def record(handle):
        order.append(getattr(handle, "slot", None) and handle.slot.index)
        return unpack(handle)

    store.unpack = record  # saved_tensors_hooks takes the bound attribute at pack time
    sizes = []
    for s in range(3):
        loss = model(**batch(s)).loss
        stored = store.stats_dict()["tensors_stored"]
        # After the forward only writes still in flight and the first reads ahead (the last stored tensor
        # and read_ahead before it, each at most one block input) hold staging.
        assert store.staging_bytes() - store.writes_in_flight_bytes() <= (2 + 1) * 2 * SEQ * 64 * 4
        loss.backward()
        sizes.append(store.stats_dict()["file_bytes"])
    indices = [i for i in order[-len(order) // 3 :] if i is not None]  # the last step's
    assert sorted(indices) == list(range(len(indices)))  # each read back once
    # Blocks run backwards, so their inputs (and the token ids before them) come back in reverse order.
    assert indices[-(LAYERS + 2) :] == sorted(indices[-(LAYERS + 2) :], reverse=True)
    assert sizes[0] == sizes[1] == sizes[2] > 0  # the same regions each step
    assert stored > 0 and store.stats_dict()["reads_ahead"] >= LAYERS


def test_reads_ahead_give_way_when_the_budget_needs_room(rig):
    """A long sequence's reads ahead must not starve what the backward cannot do without (its gradients'
    write-out took the rest of a 276 MiB budget at 8,704 tokens on tiny): a take that finds the pool full
    drops the read ahead needed last, the backward reads it again, and the result is unchanged."""
    reference = loss_and_grads(tiny_llama(), steps=1)
    model = tiny_llama()
    store = rig.activation_store(read_ahead=8)
    activation_policy.apply(model, ActivationSettings(policy="nvme", loss_chunk_tokens=0), lambda: store)
    model.train()
    model.zero_grad()
    loss = model(**batch(0)).loss  # the forward ends with reads ahead of the backward started
    store._forget_finished()
    ahead = sum(s.nbytes for s in store._slots if s.buffer is not None)
    assert ahead > 0
    want = rig.pool.stats()["largest_free"] + 1  # one byte more than is free in one piece
    hog = rig.memory.take(want, "a gradient write-out")
    dropped = store.stats_dict()["reads_dropped"]
    assert dropped >= 1 and sum(s.nbytes for s in store._slots if s.buffer is not None) < ahead
    del hog  # back to the pool
    loss.backward()
    assert abs(loss.item() - reference[0][0]) <= 1e-6 * abs(reference[0][0])
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, reference[0][1][n], rtol=1e-5, atol=1e-7), n
    s = store.stats_dict()
    assert s["bytes_read"] >= s["bytes_stored"] and store.staging_bytes() == 0


def test_small_tensors_and_parameters_stay_in_memory(rig):
    store = rig.activation_store(min_bytes=4096)
    w = torch.nn.Parameter(torch.randn(64, 64))
    assert not store.worth_storing(w) and not store.worth_storing(w.t())
    assert not store.worth_storing(torch.randn(8))  # smaller than min_bytes
    assert not store.worth_storing(torch.randn(64, 64, requires_grad=True))  # a leaf autograd needs
    assert store.worth_storing(torch.randn(64, 64))


IO_ERROR_CHILD = """
    import errno, json, pathlib, sys
    import torch  # loads libc10 before the engine extension needs it
    sys.path.insert(0, {tests!r})
    from aidaptiv_ds.engine import _C
    from aidaptiv_ds.activations import policy as activation_policy
    from aidaptiv_ds.config.settings import ActivationSettings
    from test_activation_store import Rig, tiny_llama, batch
    rig = Rig(pathlib.Path({tmp!r}), "io_uring")
    model = tiny_llama()
    store = rig.activation_store()
    activation_policy.apply(model, ActivationSettings(policy="nvme", loss_chunk_tokens=0), lambda: store)
    model.train()
    try:
        if {when!r} == "forward":
            _C._testing_fail_next_submits(errno.EIO, 1000)
        loss = model(**batch()).loss
        if {when!r} == "backward":
            _C._testing_fail_next_submits(errno.EIO, 1000)
        loss.backward()
        out = None
    except OSError as e:
        out = [e.errno, str(e)]
    _C._testing_fail_next_submits(0, 0)
    print(json.dumps(out))
"""


@pytest.mark.parametrize("when", ["forward", "backward"])
def test_io_errors_end_the_step_with_a_clear_error(tmp_path, when):
    # Every io_uring submission fails (EIO) from the start of the forward (the writes) or of the backward
    # (the reads): the step raises an OSError that says what failed and what to do; nothing crashes or hangs.
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    result = run_child(IO_ERROR_CHILD.format(tests=tests, tmp=str(tmp_path), when=when), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    err = json.loads(result.stdout.strip().splitlines()[-1])
    assert err is not None, f"an I/O error during the {when} went unnoticed"
    assert err[0] == errno.EIO
    assert "activations saved for the backward" in err[1] and "activations.policy" in err[1], err[1]
