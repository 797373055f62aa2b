"""The layer-group cache (DeepSpeed-free): LRU eviction, pins, slot exhaustion and ghosts with a store
whose requests we control, then what a read brings back after groups are written through, evicted and
taken back, on the real engine and swap files."""

import types

import pytest
import torch
from engine_helpers import run_child

from aidaptiv_ds.engine.io import IOEngine, PinnedPool
from aidaptiv_ds.swap.host_memory import HostBudgetError, HostMemory, aligned_empty
from aidaptiv_ds.swap.layer_group_cache import LayerGroupCache
from aidaptiv_ds.swap.partition_layout import ParamRecord
from aidaptiv_ds.swap.space import Extent, SwapSpace
from aidaptiv_ds.swap.store import SwapStore


def test_the_cache_imports_no_deepspeed_and_nothing_of_zero3():
    # In a fresh process: this one may have imported DeepSpeed through other test modules.
    p = run_child("""
        import sys, aidaptiv_ds.swap.layer_group_cache, aidaptiv_ds.swap.partition_layout
        bad = [m for m in sys.modules if m == 'deepspeed' or m.startswith(('deepspeed.', 'aidaptiv_ds.zero3'))]
        assert not bad, bad
    """)
    assert p.returncode == 0, p.stderr


# ---------------------------------------------------------------- with a store we control
class Request:
    def __init__(self, done=True):
        self.finished = done

    def done(self):
        return self.finished


class FakeStore:
    """Records reads and writes; every request is complete unless the test says otherwise."""

    def __init__(self):
        self.reads, self.writes = [], []
        self.writes_done = True

    def read_span(self, file, offset, buf, what=""):
        self.reads.append(offset)
        return Request()

    def write_span(self, file, offset, buf, what=""):
        t = Request(self.writes_done)
        self.writes.append((offset, t))
        return t

    def wait(self, t):
        t.finished = True


class FakeMemory:
    def __init__(self):
        self.reclaimers, self.holders = [], []

    def take(self, nbytes, what, large=False):
        return torch.zeros(nbytes, dtype=torch.uint8)

    def try_take(self, nbytes, large=False):
        return torch.zeros(nbytes, dtype=torch.uint8)

    def add_reclaimer(self, name, fn, cheap=False):
        self.reclaimers.append(name)

    def add_holder(self, name, fn):
        self.holders.append(name)


def stats():
    return types.SimpleNamespace(
        group_reads=0,
        group_hits=0,
        prefetched_groups=0,
        sync_param_reads=0,
        group_read_bytes=0,
        retained_groups=0,
        retained_bytes=0,
        retention_hits=0,
        retention_avoided_read_bytes=0,
    )


def fake_cache(groups=4, slots=2, partition=1024):
    """``groups`` layer groups of two fp32 partitions of ``partition`` elements, one after the other on disk."""
    cache = LayerGroupCache(FakeStore(), params_file=None, stats=stats())
    named, off = [], 0
    for g in range(groups):
        recs = []
        for k in range(2):
            recs.append(ParamRecord(2 * g + k, partition, torch.float32, Extent(None, off, partition * 4), None))
            off += partition * 4
        named.append((f"layers[{g}]", recs))
    cache.plan(named, FakeMemory(), slots)
    return cache


def use(cache, g):
    cache.publish(g, "test")
    cache.unpublish(g)


def cached(cache):
    return [g.index for g in cache.groups if g.buffer is not None]


def test_groups_are_contiguous_and_each_record_knows_its_group():
    cache = fake_cache(groups=3)
    for g in cache.groups:
        assert g.offset == g.records[0].extent.offset and g.nbytes == 2 * 4096
        assert all(r.group is g for r in g.records)
    assert cache.slot_bytes == 2 * 4096 and cache.planned
    assert cache.memory.reclaimers == ["finished parameter writes", "parameter write-behind"]


def test_the_least_recently_used_group_goes_first():
    cache = fake_cache(groups=4, slots=2)
    g0, g1, g2, g3 = cache.groups
    use(cache, g0)
    use(cache, g1)
    use(cache, g0)  # g1 is now the least recently used
    use(cache, g2)
    assert cached(cache) == [0, 2]
    use(cache, g3)
    assert cached(cache) == [2, 3]
    assert cache.stats.group_reads == 4 and cache.stats.group_hits == 1


def test_a_group_in_use_or_pinned_is_never_evicted():
    cache = fake_cache(groups=4, slots=2)
    g0, g1, g2, g3 = cache.groups
    cache.publish(g0, "test")  # in use
    cache.start_loading(g1, "test")  # pinned, older than anything else
    with pytest.raises(HostBudgetError) as e:
        cache.publish(g2, "partition 4")
    msg = str(e.value)
    assert "layer group layers[2] (partition 4)" in msg and "one of the 2 layer-group slots" in msg
    assert "layers[0], layers[1]" in msg and "aidaptiv.host_memory_budget" in msg
    cache.unpin(g1)
    use(cache, g2)  # takes g1's slot, not g0's
    assert cached(cache) == [0, 2]


def test_prefetch_stops_without_waiting_when_no_slot_is_free_and_never_evicts_its_own_window():
    cache = fake_cache(groups=4, slots=2)
    g0, g1, g2, g3 = cache.groups
    cache.prefetch([g0, g1, g2])  # two slots: g2 must not evict g0 or g1, which the window pins
    assert cached(cache) == [0, 1] and cache.stats.prefetched_groups == 2
    assert all(g.pins == 0 for g in cache.groups)


def test_a_ghost_is_taken_back_from_its_slot_without_a_read():
    cache = fake_cache(groups=3, slots=1)
    g0, g1, g2 = cache.groups
    use(cache, g0)
    cache.store.writes_done = False
    a = g0.records[0]
    cache.write_pieces([(a, 0, a.numel, torch.full((a.numel,), 3.0))])  # write-through still in flight
    assert len(g0.writes) == 1
    slot = g0.slot
    # Another group needs the only slot: g0 is evicted, but its slot stays its own (a ghost) until the
    # write completes, so the other group cannot load (not blocking) ...
    assert cache.ensure_loading(g1, blocking=False, reason="test") is False
    assert g0.buffer is None and g0.ghost and g0.slot == slot
    # ... and g0, wanted again, comes back from the slot as it is: no read.
    reads = len(cache.store.reads)
    use(cache, g0)
    assert not g0.ghost and g0.slot == slot and len(cache.store.reads) == reads
    assert torch.equal(g0.view(a), torch.full((a.numel,), 3.0))


def test_a_blocking_load_waits_for_a_ghost_write_and_reuses_its_slot():
    cache = fake_cache(groups=2, slots=1)
    g0, g1 = cache.groups
    use(cache, g0)
    cache.store.writes_done = False
    a = g0.records[0]
    cache.write_pieces([(a, 0, a.numel, torch.ones(a.numel))])
    use(cache, g1)  # evicts g0 (a ghost), waits for its write, takes the slot
    assert cached(cache) == [1] and not g0.ghost and g0.slot is None and g0.writes == []


def test_dropping_the_cache_forgets_every_group_nobody_uses():
    cache = fake_cache(groups=3, slots=3)
    g0, g1, g2 = cache.groups
    use(cache, g0)
    cache.publish(g1, "test")
    cache.drop_cache()
    assert cached(cache) == [1] and cache.slots.free_count() == 2


# ---------------------------------------------------------------- copies to a device still running
class FillingStore(FakeStore):
    """A read really changes the slot it lands in (each read its own byte value)."""

    def read_span(self, file, offset, buf, what=""):
        buf.fill_(len(self.reads) % 250 + 1)
        return super().read_span(file, offset, buf, what)


class CheckingFence:
    """Stands in for CUDA. ``record(slot)``: copies from the slot to the device are queued, and the device
    reads the slot's bytes whenever it gets to them, until ``wait(slot)``. The bytes are kept at the first
    record; a slot whose bytes differ at its wait (or at the end, for copies never waited for) was changed
    (a read into it, an update written through or in place, a reload) while a copy could still read it."""

    def __init__(self, pool):
        self.pool, self.in_flight, self.violations, self.waits = pool, {}, [], 0

    def _bytes(self, slot):
        return self.pool.view(slot, self.pool.slot_bytes)

    def record(self, slot):
        self.in_flight.setdefault(slot, self._bytes(slot).clone())

    def wait(self, slot):
        before = self.in_flight.pop(slot, None)
        if before is not None:
            self.waits += 1
            if not torch.equal(before, self._bytes(slot)):
                self.violations.append(slot)

    def finish(self):
        for slot in list(self.in_flight):
            self.wait(slot)
        return self.violations


def every_slot_change_after_the_device_copies(cache):
    """Reads into evicted slots, a write-through, an in-place update and its write-back, a reload in place."""
    g0, g1, g2, g3 = cache.groups
    use(cache, g0)
    a = g0.records[0]
    cache.write_pieces([(a, 0, a.numel, torch.full((a.numel,), 3.0))])  # written through into g0's slot
    use(cache, g0)
    use(cache, g1)
    use(cache, g2)  # evicts g0: its slot is read into
    use(cache, g3)  # evicts g1
    b = g3.records[1]
    r = cache.load_run([(b, 0, b.numel)], blocking=True)  # updated in place in g3's slot
    cache.wait_run(r)
    r.view(b, 0, b.numel).fill_(7.0)
    cache.store_run(r)
    cache.publish(g2, "test")
    cache.drop_cache()  # g2 is in use: read again in place


def test_no_slot_changes_while_a_device_copy_from_it_may_run():
    cache = fake_cache(groups=4, slots=2)
    cache.store = FillingStore()
    fence = cache.slots.fence = CheckingFence(cache.slots)
    every_slot_change_after_the_device_copies(cache)
    assert fence.finish() == [] and fence.waits >= 4


def test_the_checker_finds_a_slot_changed_under_a_running_copy(monkeypatch):
    """The same sequence with the waits taken out: the checker sees the slots change under the copies."""
    from aidaptiv_ds.swap.host_memory import SlotPool

    monkeypatch.setattr(SlotPool, "before_change", lambda self, index: None)
    cache = fake_cache(groups=4, slots=2)
    cache.store = FillingStore()
    fence = cache.slots.fence = CheckingFence(cache.slots)
    every_slot_change_after_the_device_copies(cache)
    assert len(fence.finish()) >= 2


# ---------------------------------------------------------------- on the real engine
class Pending:
    """A write-through that has not completed yet (the ghost window is otherwise a matter of timing)."""

    def done(self):
        return False


@pytest.fixture
def cache_on_disk(tmp_path):
    """Two layer groups (two Linear layers: weight and bias each) on disk, one slot."""
    torch.manual_seed(0)
    params = [
        p.data.reshape(-1).clone()
        for p in torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64)).parameters()
    ]
    engine = IOEngine(backend="auto")
    space = SwapSpace(str(tmp_path), rank=0)
    store = SwapStore(engine, space)
    params_file = space.create_file("params.swp", engine)
    records = []
    for i, p in enumerate(params):
        ext = params_file.allocate(p.numel() * 4)
        buf = aligned_empty(ext.reserved)
        buf[: p.numel() * 4].view(torch.float32).copy_(p)
        store.wait(store.write_span(params_file, ext.offset, buf))
        records.append(ParamRecord(i, p.numel(), torch.float32, ext, None))
    pool = PinnedPool(8 << 20)
    cache = LayerGroupCache(store, params_file, stats())
    cache.plan([("layers[0]", records[:2]), ("layers[1]", records[2:])], HostMemory(pool), slots=1)
    yield cache
    store.drain()
    space.close()
    engine.shutdown()


def read_back(cache, g):
    cache.load(g, "test")
    return {r.ds_id: g.view(r).clone() for r in g.records}


def test_a_group_taken_back_from_its_slot_has_values_written_while_it_was_evicted(cache_on_disk):
    cache = cache_on_disk
    g = next(g for g in cache.groups if len(g.records) == 2)
    other = next(x for x in cache.groups if x is not g)
    a, b = g.records
    read_back(cache, g)
    new_a = torch.full((a.numel,), 1.5)
    cache.write_pieces([(a, 0, a.numel, new_a)])  # write-through from the slot
    g.writes.append(Pending())  # ... still in flight when the group is evicted
    assert cache._evict_group() is False and g.ghost  # a ghost: its slot holds what the disk will hold
    new_b = torch.full((b.numel,), -2.5)
    cache.write_pieces([(b, 0, b.numel, new_b)])  # an update of other bytes of the ghost
    got = read_back(cache, g)  # taken back from the slot, not read
    assert torch.equal(got[a.ds_id], new_a) and torch.equal(got[b.ds_id], new_b)
    g.writes = [t for t in g.writes if not isinstance(t, Pending)]
    cache.drain_writes()
    # The disk has the same values: read the group again after the slot went to the other group.
    read_back(cache, other)
    assert g.buffer is None and not g.ghost
    got = read_back(cache, g)
    assert torch.equal(got[a.ds_id], new_a) and torch.equal(got[b.ds_id], new_b)


def test_dropping_the_cache_after_a_load_refreshes_groups_in_use(cache_on_disk):
    # A checkpoint load rewrites the swap file under the cache. A group still in use keeps its slot (its
    # partitions are views of it) and used to keep the old bytes; it is now read again in place.
    cache = cache_on_disk
    g = cache.groups[0]
    cache.publish(g, "in use across the load")
    a = g.records[0]
    view = g.view(a)  # what a partition handed out sees
    old = view.clone()
    new = torch.full((a.numel,), 7.25)
    buf = aligned_empty(a.extent.reserved)
    buf[: a.numel * 4].view(torch.float32).copy_(new)
    cache.store.wait(cache.store.write_span(cache.params_file, a.extent.offset, buf))  # "the load"
    assert torch.equal(view, old)
    cache.drop_cache()
    assert torch.equal(view, new) and g.buffer is not None and g.users == 1
    cache.unpublish(g)


def test_an_update_of_a_group_with_no_free_slot_is_staged_and_reaches_the_disk_and_a_later_cached_copy(cache_on_disk):
    """A deferred update applied while the forward holds every slot (here the one slot, by the group in use)
    and the chunk reaches into another group: it used to fail with 'host memory budget exhausted'. The run is
    staged in a buffer of its own; a copy of its group read into a slot before the write-back (a read-ahead)
    gets the updated bytes too, and so does the disk."""
    cache = cache_on_disk
    busy, target = cache.groups[0], cache.groups[1]
    cache.publish(busy, "the forward holds it")
    rec = target.records[0]
    r = cache.load_run([(rec, 0, rec.numel)], blocking=True)
    assert r is not None and r.group is None and r.home is target  # staged, not a view of a slot
    cache.wait_run(r)
    new = torch.full((rec.numel,), 3.25)
    r.view(rec, 0, rec.numel).copy_(new)
    cache.unpublish(busy)
    cache.load(target, "a read-ahead before the write-back")  # old bytes from disk into the slot
    cache.store_run(r)
    assert torch.equal(target.view(rec), new)  # the cached copy has the update
    cache.drain_writes()
    read_back(cache, busy)  # the slot goes to the other group
    assert target.buffer is None
    assert torch.equal(read_back(cache, target)[rec.ds_id], new)  # and the disk has it
