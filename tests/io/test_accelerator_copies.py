"""What changes when DeepSpeed runs on an accelerator, checked on the CPU.

- Under ``deepspeed.zero.Init`` DeepSpeed wraps ``torch.empty`` (and friends) so that a tensor made without a
  device lands on the accelerator. The host buffers the parameter swapper hands out while the model is built
  were made so, and on CUDA the first partition's write failed with "write buffer is on cuda:0". Here the
  same wrapper targets the ``meta`` device, which any machine has. Should a device tensor reach the store
  again, its refusal names the span.
- ZeRO-3 copies gradient partitions into our pinned gradient buffers without blocking, on the stream current
  when it looked the buffer up. A buffer written out under memory pressure waits for those streams only
  (not the whole device); stand-in streams count the waits.
"""

import threading

import pytest
import torch
from deepspeed.runtime.zero import partition_parameters

from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.swap.chunk_layout import SubGroup
from aidaptiv_ds.swap.host_memory import HostMemory, WriteBehind, aligned_empty
from aidaptiv_ds.swap.space import SwapSpace
from aidaptiv_ds.swap.store import SwapStore
from aidaptiv_ds.zero3.gradients import GradientPartitions, SubGroupGradients
from aidaptiv_ds.zero3.param_swapper import _empty

UNIT = 1 << 20
NUMEL = UNIT // 4


def test_a_span_of_a_device_tensor_is_refused_naming_the_span(tmp_path):
    with IOEngine(backend="posix") as engine:
        space = SwapSpace(str(tmp_path), rank=0)
        try:
            f = space.create_file("params.swp", engine)
            store = SwapStore(engine, space)
            with pytest.raises(ValueError, match=r"write of partition 7 in .*params\.swp: the buffer is on meta"):
                store.write_span(
                    f, f.allocate(4096).offset, torch.empty(4096, dtype=torch.uint8, device="meta"), "partition 7"
                )
        finally:
            space.close()


def test_host_buffers_stay_on_the_cpu_under_zero_init_tensor_wrappers(monkeypatch):
    wrapped = partition_parameters.zero_wrapper_for_fp_tensor_constructor(
        partition_parameters._orig_torch_empty, torch.bfloat16, torch.device("meta")
    )
    monkeypatch.setattr(torch, "empty", wrapped)
    assert torch.empty(1).device.type == "meta"  # what the wrapper does to a tensor without a device
    buf = aligned_empty(5000)
    assert buf.device.type == "cpu" and buf.numel() == 5000 and buf.data_ptr() % 4096 == 0
    assert _empty(torch.bfloat16).device.type == "cpu"


class _Stream:
    def __init__(self, name):
        self.name, self.waits = name, 0

    def synchronize(self):
        self.waits += 1


def _gradients(tmp_path, current_stream):
    engine = IOEngine(backend="posix")
    space = SwapSpace(str(tmp_path), rank=0)
    store = SwapStore(engine, space)
    memory = HostMemory(PinnedPool(2 * UNIT))
    f = space.create_file("optim.swp", engine)
    writes = WriteBehind(store)
    sgs = [SubGroup(i, NUMEL, [], [], None, f.allocate(UNIT)) for i in range(3)]
    grads = SubGroupGradients(store, memory, f, sgs, writes, threading.RLock(), current_stream)
    memory.add_reclaimer("optimizer write-behind", writes.finish_oldest)
    memory.add_reclaimer("gradients in host memory", grads.reclaim)
    positions = {10 + i: (sg, 0, NUMEL) for i, sg in enumerate(sgs)}
    return grads, sgs, GradientPartitions(grads, positions), (store, engine, space)


def _close(parts):
    store, engine, space = parts
    store.drain()
    engine.shutdown()
    space.close()


def test_a_written_out_gradient_waits_for_the_streams_of_its_copies_only(tmp_path):
    reduce, compute = _Stream("reduce"), _Stream("compute")
    current = [reduce]
    grads, sgs, partitions, parts = _gradients(tmp_path, lambda: current[0])
    try:
        partitions[10].fill_(1.0)  # ZeRO-3's copy into sub-group 0, queued on the reduce stream
        current[0] = compute
        partitions[11].fill_(2.0)  # sub-group 1, looked up on the compute stream
        assert (reduce.waits, compute.waits) == (0, 0)
        # The pool holds two buffers: a third look-up writes out the sub-group the step reaches last (1).
        partitions[12]
        assert sgs[1].grad is None and sgs[1].grad_on_disk
        assert (reduce.waits, compute.waits) == (0, 1)
        assert sgs[0].grad is not None
        # The step consumes sub-group 0: its copies were waited for, once.
        grads.reset(sgs[0])
        assert (reduce.waits, compute.waits) == (1, 1)
        grads.reset(sgs[0])
        assert reduce.waits == 1
        assert torch.all(grads.tensor(sgs[1]) == 2.0)  # read back with the values the copy left
    finally:
        _close(parts)


def test_on_a_synchronized_device_nothing_is_waited_for(tmp_path):
    grads, sgs, partitions, parts = _gradients(tmp_path, None)
    try:
        for ds_id in (10, 11, 12):
            partitions[ds_id].fill_(float(ds_id))
        assert grads._copy_streams == {}
        assert torch.all(grads.tensor(sgs[1]) == 11.0)
    finally:
        _close(parts)
