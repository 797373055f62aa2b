"""Re-chunking on load (aidaptiv_ds.zero3.checkpoint): optimizer state saved in one run's sub-groups and chunks
lands, element for element, in another run's (other optimizer_chunk_numel, other sub-groups, resident or on
disk). DeepSpeed-free: the swap file is a bytearray and the records are built with chunk_layout."""

import json
import types

import pytest
import torch

from aidaptiv_ds.common.sizes import align_up
from aidaptiv_ds.swap.chunk_layout import lay_out_sub_group
from aidaptiv_ds.zero3 import checkpoint

SIZES = {"embed": 9000, "a.weight": 70000, "a.bias": 300, "b.weight": 50000, "head": 9000}


class Rec:
    def __init__(self, ds_id, numel):
        self.ds_id, self.numel, self.dtype = ds_id, numel, torch.float32


class Allocator:
    def __init__(self):
        self.end = 0

    def __call__(self, nbytes):
        ext = types.SimpleNamespace(offset=self.end, reserved=align_up(max(nbytes, 1)))
        self.end += ext.reserved
        return ext


def sub_groups(records, group_numel, chunk_numel, parts, resident=()):
    """DeepSpeed-style sub-groups (runs of whole parameters up to group_numel) cut into chunks."""
    runs, run, size = [], [], 0
    for r in records:
        if run and size + r.numel > group_numel:
            runs.append(run)
            run, size = [], 0
        run.append(r)
        size += r.numel
    runs.append(run)
    alloc, out = Allocator(), []
    for i, run in enumerate(runs):
        members, off = [], 0
        for r in run:
            members.append((r, off, r.numel))
            off += r.numel
        sg = lay_out_sub_group(i, members, chunk_numel, parts, alloc, resident=i in resident)
        if sg.resident:
            sg.adopt_image(torch.zeros(sg.region.reserved, dtype=torch.uint8))
        out.append(sg)
    return out


def value(name, part, index):
    return float(hash(name) % 1000) + part * 0.25 + index * 1e-3


def saved_checkpoint(tmp_path, names, records, parts):
    """optim.bin and a manifest as save() lays them out (group of 80k elements, chunks of 16k)."""
    saved = sub_groups(records, 80000, 16384, parts)
    osw = types.SimpleNamespace(by_index=saved)
    layout = checkpoint._layout(osw, names)
    data = bytearray(sum(g["bytes"] for g in layout))
    for sg, g in zip(saved, layout):
        for c, entry in zip(sg.chunks, g["chunks"]):
            for p in c.pieces:
                name = names[p.record.ds_id][0]
                for k in range(parts):
                    vals = torch.tensor([value(name, k, p.start + i) for i in range(p.numel)], dtype=torch.float32)
                    at = entry["offset"] + k * c.part + p.flat * 4
                    data[at : at + p.numel * 4] = vals.numpy().tobytes()
        g.update(state_keys=["exp_avg", "exp_avg_sq"], state_valid=True, scalars={"step": 3})
    folder = tmp_path / "rank0"
    folder.mkdir()
    (folder / "optim.bin").write_bytes(bytes(data))
    return str(folder), {"sub_groups": layout}


@pytest.mark.parametrize(
    "group_numel,chunk_numel,resident",
    [
        (200000, 50000, ()),  # fewer, larger sub-groups and chunks
        (40000, 5000, (1,)),  # more, smaller ones, one resident in host memory
        (80000, 16384, ()),  # the saved layout itself (through the general path)
    ],
)
@pytest.mark.parametrize("parts", [2, 3], ids=["fp32-master-is-parameter", "separate-master"])
def test_state_lands_element_for_element_in_other_chunks(tmp_path, group_numel, chunk_numel, resident, parts):
    saved_records = [Rec(100 + i, n) for i, n in enumerate(SIZES.values())]
    saved_names = {r.ds_id: (name, [r.numel]) for r, name in zip(saved_records, SIZES)}
    folder, manifest = saved_checkpoint(tmp_path, saved_names, saved_records, parts)
    # This run: the same parameters under other ds_ids (a second model in the process) and other chunks.
    records = [Rec(900 + i, n) for i, n in enumerate(SIZES.values())]
    names = {r.ds_id: (name, [r.numel]) for r, name in zip(records, SIZES)}
    groups = sub_groups(records, group_numel, chunk_numel, parts, resident)
    swap = bytearray(max(c.offset + c.image_bytes for sg in groups for c in sg.chunks))

    def write(buf, handle, offset):
        swap[offset : offset + buf.numel()] = buf.numpy().tobytes()

    runtime = types.SimpleNamespace(
        memory=types.SimpleNamespace(take=lambda n, what: torch.empty(n, dtype=torch.uint8)),
        engine=types.SimpleNamespace(write=write),
    )
    reset = []
    osw = types.SimpleNamespace(
        by_index=groups, file=types.SimpleNamespace(handle=None), gradients=types.SimpleNamespace(reset=reset.append)
    )
    checkpoint._rechunk_images(runtime, osw, folder, manifest, names)
    checkpoint._restore_step_state(osw, manifest, names, True)
    for sg in groups:
        assert sg.state_keys == ["exp_avg", "exp_avg_sq"] and sg.state_valid and sg.scalars == {"step": 3}
        for c in sg.chunks:
            image = (
                c.buffer
                if sg.resident
                else torch.frombuffer(bytearray(swap[c.offset : c.offset + c.image_bytes]), dtype=torch.uint8)
            )
            for p in c.pieces:
                name = names[p.record.ds_id][0]
                for k in range(parts):
                    got = image[k * c.part + p.flat * 4 : k * c.part + (p.flat + p.numel) * 4].view(torch.float32)
                    want = torch.tensor([value(name, k, p.start + i) for i in range(p.numel)], dtype=torch.float32)
                    assert torch.equal(got, want), (name, k, p.start)
    assert len(reset) == len(groups)


def test_sub_group_gathering_parameters_of_different_step_counts_is_refused(tmp_path):
    records = [Rec(i, n) for i, n in enumerate(SIZES.values())]
    names = {r.ds_id: (name, [r.numel]) for r, name in zip(records, SIZES)}
    _, manifest = saved_checkpoint(tmp_path, names, records, 2)
    manifest["sub_groups"][0]["scalars"] = {"step": 2}
    groups = sub_groups(records, 10**6, 50000, 2)  # one sub-group gathering all of them
    osw = types.SimpleNamespace(by_index=groups, gradients=types.SimpleNamespace(reset=lambda sg: None))
    with pytest.raises(checkpoint.CheckpointMismatchError, match="step count"):
        checkpoint._restore_step_state(osw, json.loads(json.dumps(manifest)), names, True)
