"""The engine under injected faults: a broken io_uring submission, a completion thread that throws, and an
O_DIRECT piece the kernel refuses with EINVAL. Each case asserts that the waiter gets a clear error (no
hang: every child runs under a timeout), that nothing is written into a buffer after its request failed,
and that the process does not crash.

The faults come from test hooks compiled into the engine (aidaptiv_ds.engine._C._testing_*, see
csrc/include/aidaptiv/detail/test_hooks.hpp). They are process-wide, so every case runs in a child."""

import errno
import json

import pytest
from engine_helpers import BACKENDS, run_child


def test_uring_submit_failure_never_hands_the_kernel_a_failed_piece(tmp_path):
    # One io_uring_submit fails (EIO): the pieces still in the submission queue fail at once and their waiter
    # may free or reuse the buffer. The shutdown wake-up then submits for real; before the fix it handed the
    # kernel those stale reads, which wrote the file into the buffer and completed slots whose request was
    # gone (a null dereference in the completion thread). The read is 4 pieces in a ring of 8, so that the
    # wake-up NOP finds room in the submission queue. The file is kept open (a file id, not a path), as the
    # swappers do, so a stale read would find its descriptor. Once into a registered (fixed) buffer, once into
    # a plain one.
    path = tmp_path / "pattern.bin"
    path.write_bytes(b"\x5a" * (1 << 20))
    code = f"""
        import errno, json, time, torch
        from aidaptiv_ds.engine import _C
        from aidaptiv_ds.engine.io import IOEngine, PinnedPool
        pool = PinnedPool(4 << 20)
        plain = torch.empty((1 << 20) + 4096, dtype=torch.uint8)
        skip = (-plain.data_ptr()) % 4096
        out = {{}}
        for kind, buf in (("registered", pool.allocate(1 << 20)), ("plain", plain[skip:skip + (1 << 20)])):
            engine = IOEngine(backend="io_uring", pool=pool, block_size=256 << 10, queue_depth=8)
            buf.fill_(0xAA)
            f = engine.open({str(path)!r})
            _C._testing_fail_next_submits(errno.EIO, 1)
            try:
                engine.read(buf, f)
                error = None
            except OSError as e:
                error = [e.errno, e.filename, str(e)]
            try:
                engine.read(pool.allocate(4096), f)
                later = None
            except OSError as e:
                later = e.errno
            engine.shutdown()
            time.sleep(0.5)  # room for any stray completion to land
            out[kind] = {{"error": error, "later": later, "untouched": bool((buf == 0xAA).all())}}
        print(json.dumps(out))
    """
    result = run_child(code, timeout=60)
    assert result.returncode == 0, f"child died ({result.returncode}):\n{result.stderr[-3000:]}"
    out = json.loads(result.stdout)
    for kind in ("registered", "plain"):
        case = out[kind]
        assert case["error"] is not None, f"{kind}: the read whose submission failed succeeded"
        err, filename, message = case["error"]
        assert err == errno.EIO and filename == str(path)
        assert "submitting to io_uring failed" in message and "backend='posix'" in message
        assert case["later"] == errno.EIO  # the ring stays refused, with the same error
        assert case["untouched"], f"{kind}: the kernel wrote into the buffer after its request had failed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_completion_thread_exception_fails_the_request_instead_of_hanging(backend, tmp_path):
    # An exception while a completion is checked (std::bad_alloc from the hook) used to end the io_uring
    # reaper or the POSIX worker silently, and wait() then blocked forever.
    path = tmp_path / "data.bin"
    code = f"""
        import json, torch
        from aidaptiv_ds.engine import _C
        from aidaptiv_ds.engine.io import IOEngine, PinnedPool
        pool = PinnedPool(8 << 20)
        out = {{}}
        with IOEngine(backend={backend!r}, pool=pool, threads=1) as engine:
            data = pool.allocate(1 << 20)
            data.fill_(7)
            _C._testing_throw_in_next_completions(1)
            try:
                engine.write(data, {str(path)!r})
                out["error"] = None
            except OSError as e:
                out["error"] = [e.errno, e.filename, str(e)]
            # The thread survived: the engine still works.
            out["second"] = engine.write(data, {str(path)!r})
            back = pool.allocate(1 << 20)
            engine.read(back, {str(path)!r})
            out["equal"] = bool(torch.equal(back, data))
            out["errors"] = engine.stats()["errors"]
        print(json.dumps(out))
    """
    result = run_child(code, timeout=60)
    assert result.returncode == 0, f"child died ({result.returncode}):\n{result.stderr[-3000:]}"
    out = json.loads(result.stdout)
    assert out["error"] is not None, "the request whose completion check threw succeeded"
    err, filename, message = out["error"]
    assert err == errno.ENOMEM and filename == str(path)
    assert "thread ran out of memory" in message and "submit the request again" in message
    assert str(path) in message
    assert out["second"] == 1 << 20 and out["equal"] and out["errors"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_direct_einval_fallback_is_counted_and_logged_once(backend, tmp_path):
    # A file-size limit that is not block aligned cuts the O_DIRECT piece that crosses it at an unaligned
    # byte, and the kernel answers EINVAL; the engine retries that piece through the page cache. That slow
    # path used to be silent. Only the second of the two pieces reaches the limit, so no other piece's
    # failure can stop the request before the EINVAL is seen.
    path = tmp_path / "big.bin"
    code = f"""
        import json, logging, resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from aidaptiv_ds.engine.io import IOEngine, PinnedPool
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("aidaptiv_ds.engine.io").addHandler(Keep())
        pool = PinnedPool(8 << 20)
        limit = 1048576 + 1000
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        out = {{}}
        with IOEngine(backend={backend!r}, pool=pool, block_size=1 << 20) as engine:
            out["before"] = engine.stats()["direct_fallbacks"]
            try:
                engine.write(pool.allocate(2 << 20), {str(path)!r})
            except OSError as e:
                out["errno"] = e.errno
            out["after"] = engine.stats()["direct_fallbacks"]
            engine.stats()
        out["warnings"] = [m for m in records if "EINVAL" in m]
        print(json.dumps(out))
    """
    result = run_child(code, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["errno"] == errno.EFBIG
    assert out["before"] == 0 and out["after"] == 1
    assert len(out["warnings"]) == 1, out["warnings"]  # once per engine, however often stats() is read
    assert "page cache" in out["warnings"][0] and "ulimit -f" in out["warnings"][0]
