"""Gradient buffers of one reduce bucket come from one block of the pinned pool.

ZeRO-3 holds a view of every gradient buffer a reduce bucket touched until the whole bucket is partitioned,
so none of them can be freed before then. Opened one by one (as before), the bucket's small buffers land
in the holes that freed buffers left (the pool hands out from its top, the highest block that fits), and the
bucket's large buffer then finds the free space cut in two: a tiny-preset run under a 260 MiB budget with
retention failed so (29.3 MiB gradient, 27.4 MiB largest free block). Here the same sequence on a real
PinnedPool, scaled down: 7 units of pool, six 1-unit sub-groups open from an earlier bucket, one of them
consumed by the step (a hole in the middle), then a bucket of a 1-unit and a 4-unit sub-group.
"""

import re
import threading

import pytest
import torch

from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.swap.chunk_layout import SubGroup
from aidaptiv_ds.swap.host_memory import HostBudgetError, HostMemory, WriteBehind
from aidaptiv_ds.swap.space import SwapSpace
from aidaptiv_ds.swap.store import SwapStore
from aidaptiv_ds.zero3.gradients import SubGroupGradients

UNIT = 1 << 20  # bytes of a 1-unit sub-group's gradient buffer
NUMEL = UNIT // 4


@pytest.fixture
def gradients(tmp_path):
    engine = IOEngine(backend="posix")
    space = SwapSpace(str(tmp_path), rank=0)
    store = SwapStore(engine, space)
    pool = PinnedPool(7 * UNIT)
    memory = HostMemory(pool)
    f = space.create_file("optim.swp", engine)
    writes = WriteBehind(store)
    sizes = [4] + [1] * 7  # sub-group 0 is the large one (the embedding's, say)
    sub_groups = [SubGroup(i, n * NUMEL, [], [], None, f.allocate(n * UNIT)) for i, n in enumerate(sizes)]
    lock = threading.RLock()
    grads = SubGroupGradients(store, memory, f, sub_groups, writes, lock)
    memory.add_reclaimer("finished optimizer writes", lambda: writes.forget_finished(), cheap=True)
    memory.add_reclaimer("optimizer write-behind", writes.finish_oldest)
    memory.add_reclaimer("gradients in host memory", grads.reclaim)
    yield grads, sub_groups, pool
    store.drain()
    engine.shutdown()
    space.close()


def _earlier_bucket_with_a_hole(grads, sgs):
    """Sub-groups 6..1 open (as a backward opens them: the step's last first), each filled with its index;
    then the step consumes sub-group 3 and frees its buffer: a 1-unit hole in the middle of the pool."""
    for sg in sgs[6:0:-1]:
        grads.open(sg).fill_(sg.index)
    grads.reset(sgs[3])


def _partition(grads, bucket, block):
    """What ZeRO-3's partition_grads does with our buffers (with our override first when ``block``): a view
    of each member's buffer, held until the whole bucket is done, the bucket's gradient added in."""
    if block:
        grads.open_bucket(bucket)
    held = []
    for sg in bucket:
        view = grads.open(sg)
        view.add_(100.0)
        held.append(view)
    return held


def test_opened_one_by_one_the_bucket_fragments_the_pool(gradients):
    grads, sgs, pool = gradients
    _earlier_bucket_with_a_hole(grads, sgs)
    with pytest.raises(HostBudgetError) as e:
        _partition(grads, [sgs[7], sgs[0]], block=False)
    # The pool had the room: everything but the held 1-unit buffer was written out and freed, and 6 units
    # were free, but in two 3-unit blocks on either side of it.
    assert re.search(r"needs 4\.0 MiB but 1\.0 of 7\.0 MiB are in use .*largest free block 3\.0 MiB", str(e.value))


def test_opened_as_one_block_the_bucket_fits_and_nothing_is_lost(gradients):
    grads, sgs, pool = gradients
    _earlier_bucket_with_a_hole(grads, sgs)
    held = _partition(grads, [sgs[7], sgs[0]], block=True)
    assert [float(v[0]) for v in held] == [100.0, 100.0]
    # The members are adjacent in one block.
    a, b = sorted(v.data_ptr() for v in held)
    assert b - a in (UNIT, 4 * UNIT)
    # Sub-groups written out to make room come back with their values.
    for sg in sgs[1:7]:
        if sg.index == 3:
            continue
        values = grads.tensor(sg)
        assert values is not None and torch.all(values == sg.index), sg.index
        if sg.grad is not None and sg.index not in (7, 0):
            grads.reset(sg)  # keep the pool free for the next read-back


def test_a_member_already_open_elsewhere_joins_the_block_when_it_does_not_fit_beside_it(gradients):
    grads, sgs, pool = gradients
    _earlier_bucket_with_a_hole(grads, sgs)
    # Sub-group 1 is open already (from the earlier bucket) and belongs to this bucket too.
    held = _partition(grads, [sgs[1], sgs[7], sgs[0]], block=True)
    assert float(held[0][0]) == 101.0  # its earlier value, read back into the block, plus this bucket's
    ptrs = sorted(v.data_ptr() for v in held)
    assert ptrs[-1] - ptrs[0] <= 5 * UNIT  # all three in one 6-unit block
