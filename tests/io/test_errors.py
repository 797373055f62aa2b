"""Error paths: each one a clear exception (what, where, what to do), no crash, no hang, no leaked buffer."""

import errno
import gc
import json
import os
import platform
import re

import pytest
from engine_helpers import BACKENDS, run_child

from aidaptiv_ds.engine.io import Backend, IOEngine, PinnedPool


def in_use(pool):
    gc.collect()
    return pool.stats()["in_use"]


def failure(attempt, kind=OSError):
    """Run attempt(), which must raise kind; return the exception without its traceback, so that the
    frames (and the buffers they hold) are gone when the pool is checked."""
    try:
        attempt()
    except kind as e:
        e.__traceback__ = None
        return e
    raise AssertionError(f"{attempt.__name__} did not raise {kind.__name__}")


def test_missing_directory(engine, pool, tmp_path):
    before = in_use(pool)
    path = tmp_path / "no" / "such" / "dir" / "x.bin"

    def attempt():
        buf = pool.allocate(8192)
        engine.write(buf, path)

    e = failure(attempt, FileNotFoundError)
    assert e.errno == errno.ENOENT
    assert e.filename == str(path)
    assert "does not exist" in str(e) and str(path) in str(e)
    with pytest.raises(FileNotFoundError):
        engine.open(path, create=True)
    assert in_use(pool) == before


def test_read_past_end_of_file(engine, pool, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10000)
    before = in_use(pool)

    def attempt():
        buf = pool.allocate(3 << 20)
        engine.read(buf, path, 4096)

    e = failure(attempt)
    assert e.errno == errno.ENODATA
    assert e.filename == str(path)
    message = str(e)
    assert "end of file" in message and "10000 bytes" in message and str(path) in message
    assert in_use(pool) == before
    # The engine is still fine afterwards.
    ok = pool.allocate(4096)
    assert engine.read(ok, path, 4096) == 4096


def test_misaligned_buffer_and_offset(engine, pool, tmp_path):
    buf = pool.allocate(3 * 4096)
    with pytest.raises(ValueError, match="4096-byte aligned"):
        engine.write(buf[100:4196], tmp_path / "x.bin")
    with pytest.raises(ValueError, match="file offset 512"):
        engine.write(buf[:4096], tmp_path / "x.bin", 512)
    with pytest.raises(ValueError, match="not contiguous"):
        engine.write(buf.view(3, 4096)[:, :8], tmp_path / "x.bin")


def test_pool_budget_exceeded():
    pool = PinnedPool(1 << 20)
    a = pool.allocate(768 << 10)
    with pytest.raises(MemoryError) as e:
        pool.allocate(512 << 10)
    message = str(e.value)
    assert "524288 bytes" in message and "786432 of its 1048576 bytes are in use" in message
    assert "larger PinnedPool" in message
    del a
    gc.collect()
    b = pool.allocate(1 << 20)  # the freed block came back and coalesced
    assert pool.stats()["in_use"] == 1 << 20
    assert pool.stats()["high_water"] == 1 << 20
    del b


def test_swap_files_refuse_symlinks_and_other_users_files(engine, tmp_path):
    target = tmp_path / "real.bin"
    target.write_bytes(b"\0" * 4096)
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    with pytest.raises(OSError) as e:
        engine.open(link)
    assert e.value.errno == errno.ELOOP and "symbolic link" in str(e.value)
    theirs = tmp_path / "theirs.bin"
    theirs.write_bytes(b"\0" * 4096)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        engine.open(theirs)
    with pytest.raises(FileExistsError):
        engine.open(target, create=True, exclusive=True)


def test_closed_engine_and_unknown_handles(pool, tmp_path):
    engine = IOEngine(backend="posix")
    f = engine.open(tmp_path / "x.bin", create=True)
    engine.close(f)
    with pytest.raises(ValueError, match="closed"):
        engine.write(pool.allocate(4096), f)
    with pytest.raises(ValueError, match="unknown"):
        engine._engine.wait(12345)
    engine.close()
    with pytest.raises(ValueError, match="engine is closed"):
        engine.write(pool.allocate(4096), tmp_path / "y.bin")


def test_read_only_directory_as_an_unprivileged_user(shared_dir):
    # Root ignores directory permissions, so the child drops to nobody first.
    code = f"""
        import os, json
        from aidaptiv_ds.engine.io import IOEngine, PinnedPool
        # Everything is imported first: the interpreter's own files may not be readable by nobody.
        os.setgid(65534); os.setuid(65534)
        pool = PinnedPool(1 << 20)
        out = {{}}
        for backend in {BACKENDS!r}:
            with IOEngine(backend=backend) as engine:
                try:
                    engine.write(pool.allocate(8192), {shared_dir!r} + "/x.bin")
                    out[backend] = "no error"
                except PermissionError as e:
                    out[backend] = [e.errno, e.filename, str(e)]
        out["in_use"] = pool.stats()["in_use"]
        print(json.dumps(out))
    """
    result = run_child(code)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    for backend in BACKENDS:
        err, filename, message = out[backend]
        assert err == errno.EACCES and filename == f"{shared_dir}/x.bin"
        assert "permission" in message.lower()
    assert out["in_use"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_limit_in_the_middle_of_a_write(backend, tmp_path):
    # RLIMIT_FSIZE with SIGXFSZ ignored makes the kernel answer EFBIG; set in a child so the limit stays there.
    # The limit is not block aligned: the O_DIRECT piece that crosses it is cut at an unaligned byte.
    path = str(tmp_path / "big.bin")
    code = f"""
        import json, resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from aidaptiv_ds.engine.io import IOEngine, PinnedPool
        pool = PinnedPool(8 << 20)
        limit = 3 * 1048576 + 1000
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        out = {{}}
        with IOEngine(backend={backend!r}, pool=pool) as engine:
            try:
                engine.write(pool.allocate(6 << 20), {path!r})
                out["error"] = None
            except OSError as e:
                out["error"] = [e.errno, e.filename, str(e)]
        out["in_use"] = pool.stats()["in_use"]
        print(json.dumps(out))
    """
    result = run_child(code)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["error"] is not None, "writing past RLIMIT_FSIZE did not fail"
    err, filename, message = out["error"]
    assert err == errno.EFBIG and filename == path
    assert path in message and "ulimit -f" in message
    # The first piece to fail names its offset: one at or past the limit.
    offset = int(re.search(r"at offset (\d+)", message).group(1))
    assert 3 << 20 <= offset < 6 << 20
    assert out["in_use"] == 0


SECCOMP_BLOCK_IO_URING = """
    import ctypes, errno, platform, struct
    # A seccomp filter that answers EPERM to io_uring_setup (syscall 425 on x86_64 and aarch64), as
    # container runtimes' default policies do.
    arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
    def insn(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k)
    prog = b"".join([
        insn(0x20, 0, 0, 4),            # A = arch
        insn(0x15, 1, 0, arch),         # if A == arch: skip the next
        insn(0x06, 0, 0, 0x7FFF0000),   # allow (another arch)
        insn(0x20, 0, 0, 0),            # A = syscall number
        insn(0x15, 0, 1, 425),          # if A == io_uring_setup
        insn(0x06, 0, 0, 0x00050000 | errno.EPERM),
        insn(0x06, 0, 0, 0x7FFF0000),   # allow
    ])
    buf = ctypes.create_string_buffer(prog)
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0                      # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0    # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="seccomp filter written for x86_64/aarch64")
def test_auto_falls_back_to_posix_when_io_uring_is_blocked(tmp_path):
    code = (
        SECCOMP_BLOCK_IO_URING
        + f"""
    import json, torch
    from aidaptiv_ds.engine.io import IOEngine, PinnedPool
    out = {{}}
    with IOEngine(backend="auto") as engine:
        out["backend"] = engine.backend.value
        out["reason"] = engine.fallback_reason
        buf = PinnedPool(1 << 20).allocate(5000)
        buf.fill_(7)
        engine.write(buf, {str(tmp_path / "fallback.bin")!r})
        out["bytes"] = engine.read(buf, {str(tmp_path / "fallback.bin")!r})
    try:
        IOEngine(backend="io_uring")
        out["explicit"] = None
    except OSError as e:
        out["explicit"] = [e.errno, str(e)]
    print(json.dumps(out))
    """
    )
    result = run_child(code)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["backend"] == "posix" and out["bytes"] == 5000
    assert "EPERM" in out["reason"] and "POSIX" in out["reason"]
    assert "posix" in result.stderr.lower(), "the fallback should be logged"
    err, message = out["explicit"]
    assert err == errno.EPERM and "io_uring" in message and "backend='posix'" in message


def test_no_fallback_reason_when_io_uring_runs():
    with IOEngine(backend="auto") as engine:
        assert engine.backend is Backend.IO_URING
        assert engine.fallback_reason is None


def test_small_memlock_limit_falls_back_to_plain_buffers(shared_dir):
    # An unprivileged user has a small locked-memory limit (8 MiB by default): page-locking and io_uring
    # registration of a 64 MiB pool fail, and the engine must say so and keep working.
    code = f"""
        import json, os, resource, torch
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
        os.chmod({shared_dir!r}, 0o777)
        from aidaptiv_ds.engine.io import IOEngine, PinnedPool
        os.setgid(65534); os.setuid(65534)
        pool = PinnedPool(64 << 20)
        out = {{"pool": pool.stats()}}
        with IOEngine(backend="io_uring", pool=pool) as engine:
            out["fixed"] = engine.fixed_buffers
            out["note"] = engine._engine.fixed_buffers_note
            data = torch.arange(3 << 20, dtype=torch.int32).view(torch.uint8)[: (8 << 20) + 5]
            buf = pool.allocate(data.numel()); buf.copy_(data)
            engine.write(buf, {shared_dir!r} + "/m.bin")
            buf.zero_()
            engine.read(buf, {shared_dir!r} + "/m.bin")
            out["equal"] = bool(torch.equal(buf, data))
        print(json.dumps(out))
    """
    result = run_child(code)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["pool"]["locked"] is False and out["pool"]["lock_method"] == "none"
    assert "ulimit -l" in out["pool"]["lock_note"]
    assert out["fixed"] is False and "ulimit -l" in out["note"]
    assert out["equal"]
    assert "ulimit -l" in result.stderr, "the unlocked pool should be logged once"
