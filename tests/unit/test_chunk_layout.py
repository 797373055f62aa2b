"""How optimizer sub-groups are cut into chunks and laid out in the optimizer swap file (DeepSpeed-free)."""

import os
import subprocess
import sys

import torch

from aidaptiv_ds.swap.chunk_layout import (
    PARTS,
    STATE_SLOTS,
    Chunk,
    Piece,
    cut_into_chunks,
    image_parts,
    lay_out_sub_group,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_layout_imports_no_deepspeed_and_nothing_of_zero3():
    # In a fresh process: this one may have imported DeepSpeed through other test modules.
    code = (
        "import sys, aidaptiv_ds.swap.chunk_layout; "
        "bad = [m for m in sys.modules if m == 'deepspeed' or m.startswith(('deepspeed.', 'aidaptiv_ds.zero3'))]; "
        "assert not bad, bad"
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr


class Rec:
    def __init__(self, numel, dtype=torch.float32):
        self.numel, self.dtype = numel, dtype


def members_of(recs):
    members, off = [], 0
    for r in recs:
        members.append((r, off, r.numel))
        off += r.numel
    return members, off


def test_chunks_cover_the_sub_group_and_split_parameters_only_at_4kib():
    recs = [Rec(768), Rec(5000), Rec(3000), Rec(1_000_000), Rec(10)]
    members, off = members_of(recs)
    chunks = cut_into_chunks(members, 100_000)
    assert sum(n for _, n, _ in chunks) == off
    pos = 0
    covered = {id(r): [] for r in recs}
    for start, n, pieces in chunks:
        assert start == pos and n <= 100_000
        assert sum(p.numel for p in pieces) == n and pieces[0].flat == 0
        for p in pieces:
            covered[id(p.record)].append((p.start, p.numel))
            assert (p.start * 4) % 4096 == 0  # a split inside a parameter falls at 4 KiB of its bytes
        pos += n
    for r in recs:
        spans = sorted(covered[id(r)])
        assert spans[0][0] == 0 and sum(n for _, n in spans) == r.numel
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_bf16_parameters_split_at_4kib_of_bf16_bytes():
    chunks = cut_into_chunks([(Rec(100_000, torch.bfloat16), 0, 100_000)], 30_000)
    starts = [p.start for _, _, ps in chunks for p in ps]
    assert all((s * 2) % 4096 == 0 for s in starts) and len(chunks) == 4


def test_a_parameter_that_cannot_split_in_the_room_left_starts_the_next_chunk():
    # 1000 fp32 elements are left in the first chunk, less than 4 KiB (1024 elements) of the second
    # parameter: it is not split there but starts a new chunk, which ends at 3 x 4 KiB of it (3072
    # elements, the most that fits in 4000 at 4 KiB).
    chunks = cut_into_chunks(members_of([Rec(3000), Rec(5000)])[0], 4000)
    assert [(s, n) for s, n, _ in chunks] == [(0, 3000), (3000, 3072), (6072, 1928)]
    assert [(p.start, p.numel, p.flat) for p in chunks[1][2]] == [(0, 3072, 0)]
    assert [(p.start, p.numel, p.flat) for p in chunks[2][2]] == [(3072, 1928, 0)]


def test_a_chunk_smaller_than_4kib_of_a_parameter_still_takes_4kib_of_it():
    chunks = cut_into_chunks([(Rec(5000), 0, 5000)], 500)
    assert [n for _, n, _ in chunks] == [1024] * 4 + [904]


class Allocator:
    """A swap file's bump allocator: 4 KiB-aligned extents one after the other."""

    class Extent:
        def __init__(self, offset, nbytes):
            self.offset, self.nbytes = offset, nbytes
            self.reserved = -(-nbytes // 4096) * 4096

    def __init__(self, start=8192):
        self.next = start

    def __call__(self, nbytes):
        e = self.Extent(self.next, nbytes)
        self.next += e.reserved
        return e


def test_chunk_images_are_contiguous_in_the_region_and_the_gradient_follows():
    recs = [Rec(3000), Rec(5000), Rec(10)]
    members, numel = members_of(recs)
    alloc = Allocator()
    sg = lay_out_sub_group(7, members, 4000, PARTS, alloc, resident=False)
    assert sg.index == 7 and sg.numel == numel and [c.numel for c in sg.chunks] == [3000, 3072, 1938]
    off = sg.region.offset
    for c in sg.chunks:
        assert c.offset == off and c.parts == PARTS
        assert c.part == -(-c.numel * 4 // 4096) * 4096 and c.image_bytes == PARTS * c.part
        off += c.image_bytes
    assert sg.region.nbytes == off - sg.region.offset
    assert sg.grad_extent.offset == sg.region.offset + sg.region.reserved and sg.grad_extent.nbytes == numel * 4
    assert sg.part == -(-numel * 4 // 4096) * 4096


def test_state_slots_follow_the_master_or_start_the_image():
    assert image_parts(master_is_parameter=True) == STATE_SLOTS and image_parts(False) == PARTS
    for parts, first_state in ((PARTS, 1), (STATE_SLOTS, 0)):
        c = Chunk(0, 1500, 0, [Piece(Rec(1500), 0, 1500, 0)], parts)
        c.buffer = torch.zeros(c.image_bytes, dtype=torch.uint8)
        for k in range(parts):
            c.slot(k).fill_(k + 1)
        assert c.state_start == first_state * c.part
        assert [float(c.state_slot(j)[0]) for j in range(STATE_SLOTS)] == [first_state + 1, first_state + 2]
        assert c.state_slot(0).numel() == 1500 and c.state_slot(0).dtype == torch.float32


def test_a_chunks_gradient_is_read_in_whole_4kib_blocks():
    c = Chunk(start=1500, numel=2000, offset=0, pieces=[], parts=PARTS)
    lo, hi, shift = c.grad_cover()
    assert (lo, hi, shift) == (4096, 16384, 1500 * 4 - 4096)
    assert lo <= c.start * 4 and (c.start + c.numel) * 4 <= hi and lo + shift == c.start * 4


def test_a_resident_sub_group_keeps_every_chunk_as_a_view_of_its_image():
    members, _ = members_of([Rec(3000), Rec(5000)])
    sg = lay_out_sub_group(0, members, 4000, STATE_SLOTS, Allocator(), resident=True)
    image = torch.zeros(sg.region.reserved, dtype=torch.uint8)
    sg.adopt_image(image)
    for k, c in enumerate(sg.chunks):
        c.state_slot(1).fill_(k + 1)
        at = c.offset - sg.region.offset + c.part
        assert c.buffer.data_ptr() == image.data_ptr() + c.offset - sg.region.offset
        assert float(image[at : at + 4].view(torch.float32)) == k + 1
