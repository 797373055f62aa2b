"""Every call form of DeepSpeed 0.19's aio_handle binding (ops/csrc/aio/py_lib/py_ds_aio.cpp) works on AioHandle
with DeepSpeed's return values: positional and keyword arguments under DeepSpeed's names (``fd``, ``async``,
``file_offset``, ``example_tenosr`` as DeepSpeed spells it, ...), and both overloads of async_pwrite, the
file-descriptor one included (DeepSpeed's FastFileWriter passes an O_DIRECT descriptor).

The same script runs on DeepSpeed's libaio handle where its op builds, and both must give the same return
values and files; the expected values are also written out, so that the forms are checked without it."""

import hashlib
import os

import pytest
import torch

from aidaptiv_ds.engine.aio_handle import AioHandle

KIB4 = 4096


def calls(handle, folder):
    """Each call form once; returns [(form, return value)] and {file name: sha256}."""
    f = lambda name: os.path.join(folder, name)
    out = []
    u8 = torch.empty(0, dtype=torch.uint8)
    a = handle.new_cpu_locked_tensor(4 * KIB4, u8)
    b = handle.new_cpu_locked_tensor(num_elem=4 * KIB4, example_tenosr=u8)
    a.copy_(torch.arange(a.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    b.copy_(torch.arange(b.numel(), dtype=torch.int64).remainder(241).to(torch.uint8))
    plain = torch.arange(2 * KIB4, dtype=torch.int32)  # torch's allocator: neither pinned nor page aligned
    out.append(("is_pinned", handle.is_pinned(a), handle.is_pinned(buffer=b), handle.is_pinned(buffer=plain)))

    # async_pwrite, filename overload
    out.append(("async_pwrite(buffer, filename)", handle.async_pwrite(a, f("w1.bin"))))
    out.append(("async_pwrite(buffer, filename, file_offset)", handle.async_pwrite(b, f("w1.bin"), 4 * KIB4)))
    out.append(
        (
            "async_pwrite(buffer=, filename=, file_offset=)",
            handle.async_pwrite(buffer=a, filename=f("w2.bin"), file_offset=KIB4),
        )
    )
    out.append(("wait after 3", handle.wait()))
    # async_pwrite, descriptor overload (O_DIRECT, as DeepSpeed's FastFileWriter opens it)
    fd = os.open(f("fd.bin"), os.O_DIRECT | os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        out.append(("async_pwrite(buffer, fd)", handle.async_pwrite(a, fd)))
        out.append(("async_pwrite(buffer, fd, file_offset)", handle.async_pwrite(b, fd, 4 * KIB4)))
        out.append(("async_pwrite(buffer, fd=, file_offset=)", handle.async_pwrite(a, fd=fd, file_offset=8 * KIB4)))
        out.append(
            ("async_pwrite(buffer=, fd=) unpinned", handle.async_pwrite(buffer=plain, fd=fd, file_offset=12 * KIB4))
        )
        out.append(("wait after 4 fd writes", handle.wait()))
    finally:
        os.close(fd)
    out.append(("fd still open by the caller", "closed"))  # os.close above raised nothing: it was still open

    # sync and parallel writes
    out.append(("sync_pwrite(buffer, filename)", handle.sync_pwrite(a, f("s.bin"))))
    out.append(
        (
            "sync_pwrite(buffer=, filename=, file_offset=)",
            handle.sync_pwrite(buffer=b, filename=f("s.bin"), file_offset=4 * KIB4),
        )
    )
    out.append(
        ("pwrite(buffer, filename, validate, async, file_offset) sync", handle.pwrite(a, f("p.bin"), False, False, 0))
    )
    out.append(
        (
            "pwrite(buffer=, filename=, validate=, async=True, file_offset=)",
            handle.pwrite(buffer=b, filename=f("p.bin"), validate=False, file_offset=4 * KIB4, **{"async": True}),
        )
    )
    out.append(("pwrite(buffer, filename, validate, async) async", handle.pwrite(plain, f("p2.bin"), False, True)))
    out.append(("wait after 2", handle.wait()))
    out.append(
        (
            "write(buffer=, filename=, validate=, file_offset=)",
            handle.write(buffer=a, filename=f("whole.bin"), validate=False, file_offset=0),
        )
    )

    # reads
    r = [handle.new_cpu_locked_tensor(4 * KIB4, u8) for _ in range(6)]
    rp = torch.zeros(2 * KIB4, dtype=torch.int32)
    out.append(("async_pread(buffer, filename)", handle.async_pread(r[0], f("w1.bin"))))
    out.append(("async_pread(buffer, filename, file_offset)", handle.async_pread(r[1], f("fd.bin"), 4 * KIB4)))
    out.append(
        (
            "async_pread(buffer=, filename=, file_offset=)",
            handle.async_pread(buffer=rp, filename=f("fd.bin"), file_offset=12 * KIB4),
        )
    )
    out.append(("wait after 3 reads", handle.wait()))
    out.append(
        (
            "sync_pread(buffer=, filename=, file_offset=)",
            handle.sync_pread(buffer=r[2], filename=f("s.bin"), file_offset=4 * KIB4),
        )
    )
    out.append(
        (
            "pread(buffer, filename, validate, async, file_offset) sync",
            handle.pread(r[3], f("fd.bin"), False, False, 8 * KIB4),
        )
    )
    out.append(
        (
            "pread(buffer=, filename=, validate=, async=True, file_offset=)",
            handle.pread(buffer=r[4], filename=f("p.bin"), validate=False, file_offset=4 * KIB4, **{"async": True}),
        )
    )
    out.append(("wait after 1", handle.wait()))
    out.append(
        (
            "read(buffer=, filename=, validate=, file_offset=)",
            handle.read(buffer=r[5], filename=f("whole.bin"), validate=False, file_offset=0),
        )
    )
    for i, t in enumerate(r + [rp]):
        out.append((f"read bytes {i}", hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()))
    out.append(
        (
            "free_cpu_locked_tensor(tensor=)",
            handle.free_cpu_locked_tensor(tensor=r[0]),
            handle.free_cpu_locked_tensor(a),
        )
    )
    files = {}
    for name in sorted(os.listdir(folder)):
        with open(f(name), "rb") as fh:
            files[name] = hashlib.sha256(fh.read()).hexdigest()
    return out, files


# DeepSpeed 0.19.8's return values for the script above (async forms 0, wait() and the synchronous
# parallel forms the count of ops they waited for, read()/write() 0).
EXPECTED = {
    "is_pinned": (True, True, False),
    "async_pwrite(buffer, filename)": (0,),
    "async_pwrite(buffer, filename, file_offset)": (0,),
    "async_pwrite(buffer=, filename=, file_offset=)": (0,),
    "wait after 3": (3,),
    "async_pwrite(buffer, fd)": (0,),
    "async_pwrite(buffer, fd, file_offset)": (0,),
    "async_pwrite(buffer, fd=, file_offset=)": (0,),
    "async_pwrite(buffer=, fd=) unpinned": (0,),
    "wait after 4 fd writes": (4,),
    "fd still open by the caller": ("closed",),
    "sync_pwrite(buffer, filename)": (1,),
    "sync_pwrite(buffer=, filename=, file_offset=)": (1,),
    "pwrite(buffer, filename, validate, async, file_offset) sync": (1,),
    "pwrite(buffer=, filename=, validate=, async=True, file_offset=)": (0,),
    "pwrite(buffer, filename, validate, async) async": (0,),
    "wait after 2": (2,),
    "write(buffer=, filename=, validate=, file_offset=)": (0,),
    "async_pread(buffer, filename)": (0,),
    "async_pread(buffer, filename, file_offset)": (0,),
    "async_pread(buffer=, filename=, file_offset=)": (0,),
    "wait after 3 reads": (3,),
    "sync_pread(buffer=, filename=, file_offset=)": (1,),
    "pread(buffer, filename, validate, async, file_offset) sync": (1,),
    "pread(buffer=, filename=, validate=, async=True, file_offset=)": (0,),
    "wait after 1": (1,),
    "read(buffer=, filename=, validate=, file_offset=)": (0,),
    "free_cpu_locked_tensor(tensor=)": (True, True),
}


def test_every_call_form_returns_deepspeeds_values(tmp_path):
    handle = AioHandle(block_size=8192, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=1)
    out, files = calls(handle, str(tmp_path))
    got = {form: tuple(values) for form, *values in out if not form.startswith("read bytes")}
    assert got == EXPECTED
    # What each file holds, from the buffers' known contents.
    a = (torch.arange(4 * KIB4) % 251).to(torch.uint8).numpy().tobytes()
    b = (torch.arange(4 * KIB4) % 241).to(torch.uint8).numpy().tobytes()
    plain = torch.arange(2 * KIB4, dtype=torch.int32).numpy().tobytes()
    assert (tmp_path / "fd.bin").read_bytes() == a + b + a + plain
    assert (tmp_path / "w1.bin").read_bytes() == a + b
    assert (tmp_path / "w2.bin").read_bytes() == bytes(KIB4) + a


def test_constructor_and_getters_by_keyword():
    handle = AioHandle(block_size=4096, queue_depth=4, single_submit=True, overlap_events=False, intra_op_parallelism=2)
    assert (
        handle.get_block_size(),
        handle.get_queue_depth(),
        handle.get_single_submit(),
        handle.get_overlap_events(),
        handle.get_intra_op_parallelism(),
        handle.get_alignment(),
    ) == (4096, 4, True, False, 2, 1024)


def test_async_pwrite_refuses_a_filename_and_an_fd_together(tmp_path):
    handle = AioHandle()
    with pytest.raises(TypeError, match="not both"):
        handle.async_pwrite(torch.zeros(KIB4, dtype=torch.uint8), str(tmp_path / "x.bin"), fd=3)


def test_same_call_forms_as_deepspeed(tmp_path):
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        deepspeed_aio = AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # the op builds just in time and needs libaio-dev
        pytest.skip(f"DeepSpeed's async_io op cannot be built here ({type(e).__name__}: {e})")
    args = dict(block_size=8192, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=1)
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "ours").mkdir()
    theirs, theirs_files = calls(deepspeed_aio.aio_handle(**args), str(tmp_path / "deepspeed"))
    ours, ours_files = calls(AioHandle(**args), str(tmp_path / "ours"))
    for a, b in zip(theirs, ours):
        assert a == b, f"DeepSpeed gave {a}, we gave {b}"
    assert len(theirs) == len(ours)
    assert theirs_files == ours_files
