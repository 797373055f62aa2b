"""The parameter swapper's layer-group cache on the real engine and swap files, driven directly (no DeepSpeed
training): what a forward reads after groups are written through, evicted and taken back."""
import types

import pytest
import torch
import torch.nn as nn

from aidaptiv_ds.config import SwapSettings
from aidaptiv_ds.zero3.param_swapper import AidaptivParamSwapper
from aidaptiv_ds.zero3.runtime import SwapRuntime


class Pending:
    """A write-through that has not completed yet (the ghost window is otherwise a matter of timing)."""

    def done(self):
        return False


@pytest.fixture
def swapper(tmp_path):
    """Two layer groups (two Linear layers: weight and bias each) on disk, one slot."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64))
    settings = SwapSettings.from_block({"enabled": True, "nvme_path": str(tmp_path)})
    runtime = SwapRuntime(settings, rank=0, model_dtype=torch.float32)
    sw = AidaptivParamSwapper(runtime)
    for i, p in enumerate(model.parameters()):
        p.ds_id = i
        p.ds_tensor = types.SimpleNamespace(data=torch.empty(0), status=None, dtype=torch.float32)
        sw.get_buffer(p, p.numel()).copy_(p.data.reshape(-1))
        sw.swap_out_and_release([p])
    runtime.start_training(8 << 20)
    sw.plan(model, layer_group_size=1, slots=1)
    yield sw, model
    runtime.close()


def cached(sw, g):
    sw._ensure_loading(g, blocking=True, reason="test")
    sw._wait_group(g)
    return {r.ds_id: g.view(r).clone() for r in g.records}


def test_a_group_taken_back_from_its_slot_has_values_written_while_it_was_evicted(swapper):
    sw, model = swapper
    g = next(g for g in sw.groups if len(g.records) == 2)
    other = next(x for x in sw.groups if x is not g)
    a, b = g.records
    cached(sw, g)
    new_a = torch.full((a.numel,), 1.5)
    sw.write_pieces([(a, 0, a.numel, new_a)])  # write-through from the slot
    g.writes.append(Pending())                # ... still in flight when the group is evicted
    assert sw._evict_group() is False and g.ghost  # a ghost: its slot holds what the disk will hold
    new_b = torch.full((b.numel,), -2.5)
    sw.write_pieces([(b, 0, b.numel, new_b)])  # an update of other bytes of the ghost
    got = cached(sw, g)                        # taken back from the slot, not read
    assert torch.equal(got[a.ds_id], new_a) and torch.equal(got[b.ds_id], new_b)
    g.writes = [t for t in g.writes if not isinstance(t, Pending)]
    sw.drain_writes()
    # The disk has the same values: read the group again after the slot went to the other group.
    cached(sw, other)
    assert g.buffer is None and not g.ghost
    got = cached(sw, g)
    assert torch.equal(got[a.ds_id], new_a) and torch.equal(got[b.ds_id], new_b)
