"""AioHandle against DeepSpeed's own libaio aio_handle: the same calls give the same return values, the same
bytes in files and the same bytes in buffers."""

import errno
import hashlib
import os

import pytest
import torch

from aidaptiv_ds.engine.aio_handle import AioHandle


@pytest.fixture(scope="module")
def deepspeed_aio():
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # the op builds just in time and needs libaio-dev
        pytest.skip(
            f"DeepSpeed's async_io op cannot be built here ({type(e).__name__}: {e}); "
            "install libaio-dev and set TORCH_EXTENSIONS_DIR to a writable folder"
        )


def script(handle, folder):
    """One sequence of aio_handle calls; returns every return value and every byte it read."""
    out = []
    example16 = torch.empty(0, dtype=torch.float16)
    pinned = handle.new_cpu_locked_tensor(3 * 4096, example16)  # 24 KiB of fp16
    out.append(
        (
            "locked",
            pinned.dtype,
            tuple(pinned.shape),
            handle.is_pinned(pinned),
            handle.is_pinned(pinned[2048:]),
            handle.is_pinned(torch.empty(4096)),
        )
    )
    pinned.copy_(torch.linspace(-3, 3, pinned.numel(), dtype=torch.float16))
    plain = torch.arange(5120, dtype=torch.int32)  # 20 KiB, ordinary memory
    odd_view = pinned.view(torch.uint8)[1024 : 1024 + 5120]  # 1 KiB into a page: not 4 KiB aligned
    f = lambda name: os.path.join(folder, name)
    out.append(
        (
            "async writes",
            handle.async_pwrite(pinned, f("a.bin")),
            handle.async_pwrite(plain, f("b.bin"), 0),
            handle.async_pwrite(odd_view, f("c.bin"), 8192),
            handle.async_pwrite(plain, f("a.bin"), 3 * 8192),
        )
    )
    out.append(("wait", handle.wait()))
    out.append(("sync_pwrite", handle.sync_pwrite(plain[:1024], f("d.bin"), 1024)))  # unaligned offset
    out.append(("pwrite sync", handle.pwrite(pinned, f("e.bin"), False, False, 4096)))
    out.append(("pwrite async", handle.pwrite(pinned, f("e.bin"), False, True, 0), handle.wait()))

    r1 = handle.new_cpu_locked_tensor(3 * 4096, example16)
    r2 = torch.zeros(5120, dtype=torch.int32)
    r3 = torch.zeros(5120, dtype=torch.uint8)
    out.append(
        (
            "async reads",
            handle.async_pread(r1, f("a.bin")),
            handle.async_pread(r2, f("a.bin"), 3 * 8192),
            handle.async_pread(r3, f("c.bin"), 8192),
        )
    )
    r4 = torch.zeros(1024, dtype=torch.int32)
    out.append(("sync_pread after 3 async", handle.sync_pread(r4, f("d.bin"), 1024)))
    r5 = torch.zeros_like(pinned)
    out.append(("pread sync", handle.pread(r5, f("e.bin"), False, False, 4096)))
    out.append(("pread async", handle.pread(r5, f("e.bin"), False, True, 0), handle.wait()))
    # DeepSpeed's read() does O_DIRECT straight into the buffer (no bounce): give it an aligned one.
    whole = handle.new_cpu_locked_tensor(os.path.getsize(f("b.bin")), torch.empty(0, dtype=torch.uint8))
    out.append(("read", handle.read(whole, f("b.bin"), False)))
    aligned = handle.new_cpu_locked_tensor(plain.numel(), plain)  # same reason as above
    aligned.copy_(plain)
    out.append(("write", handle.write(aligned, f("g.bin"), False)))
    for name, t in (("r1", r1), ("r2", r2), ("r3", r3), ("r4", r4), ("r5", r5), ("whole", whole)):
        raw = t.view(torch.int16 if t.dtype == torch.float16 else torch.uint8).numpy().tobytes()
        out.append((name, t.dtype, hashlib.sha256(raw).hexdigest()))
    out.append(("free", handle.free_cpu_locked_tensor(r1)))
    files = {}
    for name in sorted(os.listdir(folder)):
        with open(f(name), "rb") as fh:
            files[name] = hashlib.sha256(fh.read()).hexdigest()
    return out, files


def test_same_results_as_deepspeed(deepspeed_aio, tmp_path):
    theirs_dir, ours_dir = tmp_path / "deepspeed", tmp_path / "ours"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    args = dict(block_size=8192, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=1)
    theirs_handle, ours_handle = deepspeed_aio.aio_handle(**args), AioHandle(**args)
    getters = [
        "get_block_size",
        "get_queue_depth",
        "get_single_submit",
        "get_overlap_events",
        "get_intra_op_parallelism",
        "get_alignment",
    ]
    assert [getattr(ours_handle, g)() for g in getters] == [getattr(theirs_handle, g)() for g in getters]
    theirs, theirs_files = script(theirs_handle, str(theirs_dir))
    ours, ours_files = script(ours_handle, str(ours_dir))
    for a, b in zip(theirs, ours):
        assert a == b, f"DeepSpeed gave {a}, we gave {b}"
    assert len(theirs) == len(ours)
    assert theirs_files.keys() == ours_files.keys()
    for name in theirs_files:
        assert theirs_files[name] == ours_files[name], f"file {name} differs"


def test_defaults_match_deepspeed(deepspeed_aio):
    theirs, ours = deepspeed_aio.aio_handle(), AioHandle()
    for g in (
        "get_block_size",
        "get_queue_depth",
        "get_single_submit",
        "get_overlap_events",
        "get_intra_op_parallelism",
        "get_alignment",
    ):
        assert getattr(ours, g)() == getattr(theirs, g)(), g


def test_deliberate_differences(tmp_path):
    handle = AioHandle(intra_op_parallelism=2)
    # Sizes that are not a multiple of the disk block are written exactly (DeepSpeed silently writes nothing).
    data = torch.arange(3001, dtype=torch.uint8)[:3000]
    assert handle.sync_pwrite(data, str(tmp_path / "odd.bin")) == 1
    assert (tmp_path / "odd.bin").read_bytes() == data.numpy().tobytes()
    # read()/write() work on any buffer (DeepSpeed's do O_DIRECT on it as it is, and silently do nothing
    # when it is not aligned).
    plain = torch.arange(5000, dtype=torch.int32)
    assert handle.write(plain, str(tmp_path / "w.bin"), False) == 0
    back = torch.zeros_like(plain)
    assert handle.read(back, str(tmp_path / "w.bin"), False) == 0
    assert torch.equal(back, plain)
    # wait() with nothing queued returns 0 (DeepSpeed asserts).
    assert handle.wait() == 0
    # Errors raise instead of asserting or returning -1.
    with pytest.raises(ValueError, match="intra_op_parallelism 2"):
        handle.async_pwrite(torch.zeros(4097, dtype=torch.uint8), str(tmp_path / "x.bin"))
    with pytest.raises(FileNotFoundError):
        handle.async_pread(torch.zeros(4096, dtype=torch.uint8), str(tmp_path / "missing.bin"))
    with pytest.raises(OSError) as e:
        handle.async_pread(torch.zeros(8192, dtype=torch.uint8), str(tmp_path / "odd.bin"))
    assert e.value.errno == errno.ENODATA
    # A failure among queued ops is raised by wait() after the others drained; the handle stays usable.
    good = torch.ones(4096, dtype=torch.uint8)
    assert handle.async_pwrite(good, str(tmp_path / "good.bin")) == 0
    assert handle.wait() == 1
    assert (tmp_path / "good.bin").read_bytes() == bytes([1]) * 4096


def test_failed_op_is_raised_by_wait_after_the_rest(tmp_path, monkeypatch):
    handle = AioHandle()
    good = torch.full((8 << 20,), 5, dtype=torch.uint8)
    assert handle.async_pwrite(good, str(tmp_path / "big.bin")) == 0
    short = tmp_path / "short.bin"
    short.write_bytes(b"\1" * 100)
    # Let the read past the end through the submission check, so that the engine meets the end of file.
    monkeypatch.setattr(handle, "_file_size", lambda filename: 1 << 30)
    buf = handle.new_cpu_locked_tensor(8192, torch.empty(0, dtype=torch.uint8))
    assert handle.async_pread(buf, str(short)) == 0
    assert handle.async_pwrite(good[:4096], str(tmp_path / "after.bin")) == 0
    with pytest.raises(OSError) as e:
        handle.wait()
    assert e.value.errno == errno.ENODATA and e.value.filename == str(short)
    # Every other op drained: both writes are complete on disk.
    assert (tmp_path / "big.bin").read_bytes() == bytes([5]) * (8 << 20)
    assert (tmp_path / "after.bin").read_bytes() == bytes([5]) * 4096
    assert handle.wait() == 0


def test_install_replaces_and_restores_asyncio_builder():
    from deepspeed.runtime.swap_tensor import (
        partitioned_optimizer_swapper,
        partitioned_param_swapper,
        pipelined_optimizer_swapper,
    )

    from aidaptiv_ds.zero3 import aio_builder

    modules = (partitioned_param_swapper, partitioned_optimizer_swapper, pipelined_optimizer_swapper)
    originals = [m.AsyncIOBuilder for m in modules]
    aio_builder.install()
    try:
        for m in modules:
            assert m.AsyncIOBuilder is aio_builder.AidaptivAsyncIOBuilder
            assert m.AsyncIOBuilder().load(verbose=False).aio_handle is AioHandle
        aio_builder.install()  # idempotent
    finally:
        aio_builder.uninstall()
    assert [m.AsyncIOBuilder for m in modules] == originals
    assert not aio_builder.installed()
