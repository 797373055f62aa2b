"""The CUDA pipeline (file <-> pinned staging <-> GPU). Skipped without CUDA; run on a GPU machine."""

import os

import pytest
import torch

from aidaptiv_ds.engine import _C
from aidaptiv_ds.engine.io import IOEngine, PinnedPool

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and _C.WITH_CUDA), reason="needs a CUDA device and aidaptiv_ds built with CUDA"
)


@pytest.fixture(scope="module")
def pool():
    return PinnedPool(64 << 20)


@pytest.mark.parametrize("backend", ["io_uring", "posix"])
@pytest.mark.parametrize("nbytes", [1, 4097, (5 << 20) + 123, 64 << 20])
def test_round_trip_through_the_gpu(backend, nbytes, pool, tmp_path):
    assert pool.stats()["lock_method"] == "cudaHostRegister"
    staging = pool.allocate(2 * (256 << 10))  # small halves: many chunks, so the pipeline really turns
    g = torch.Generator(device="cuda").manual_seed(nbytes)
    # Produced by a kernel on the current stream just before: the side stream must wait for it.
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g) ^ 0x5A
    path = tmp_path / "gpu.bin"
    with IOEngine(backend=backend, pool=pool) as engine:
        assert engine.write_from_device(src, path, 4096, staging) == nbytes
        assert os.path.getsize(path) == 4096 + nbytes
        with open(path, "rb") as f:
            f.seek(4096)
            assert f.read() == src.cpu().numpy().tobytes()
        dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        assert engine.read_to_device(dst, path, 4096, staging) == nbytes
        assert torch.equal(dst, src)
        # Typed tensors work the same way (bytes are bytes).
        x = torch.randn(1000, 37, device="cuda")
        engine.write_from_device(x, path, 0, staging)
        y = torch.empty_like(x)
        engine.read_to_device(y, path, 0)  # staging taken from the engine's pool
        assert torch.equal(x, y)


def test_errors_drain_and_release(pool, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\1" * 10000)
    before = pool.stats()["in_use"]
    with IOEngine(pool=pool) as engine:
        staging = pool.allocate(2 * (64 << 10))
        dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        with pytest.raises(OSError) as e:
            engine.read_to_device(dst, path, 0, staging)
        assert "end of file" in str(e.value)
        with pytest.raises(ValueError, match="CUDA tensor"):
            engine.read_to_device(torch.zeros(10), path, 0, staging)
        del staging, e
    assert pool.stats()["in_use"] == before
