"""bench/generate_offload.py's summary: one row per side that ran, a ratio against each baseline from the repeats
they shared, a baseline the cap killed said as such (not as the last line of its stderr), and the GPU's cap and
an uncapped host said where they apply."""

import importlib.util
import os

import pytest
from helpers import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "generate_offload", os.path.join(REPO, "bench", "generate_offload.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(device="cpu", cap=2 << 30):
    common = {"machine": "test machine", "device": device, "gpu_cap_bytes": 3 << 29, "cap_bytes": cap,
              "shape": "tinyllama-1.1b", "dtype": "float32", "weight_bytes": 4 << 30, "budget_bytes": 1 << 30,
              "new_tokens": 16}  # fmt: skip
    ref = dict(common, side="in_memory", repeat=0, rc=0, token_ids=[1, 2, 3], decode_s=1.0, new_tokens=16,
               tokens_per_s=2.0, ttft_s=0.5)  # fmt: skip
    disk = dict(common, side="disk", repeat=0, rc=0, file_mb=4096, read_gbps=2.0, read_gbps_1gib=2.2)
    rows = [ref, disk]
    for rep, (ours, acc) in enumerate([(0.5, 0.25), (0.6, 0.2)]):
        rows.append(dict(common, side="aidaptiv", repeat=rep, rc=0, tokens_per_s=ours, ttft_s=2.0, layout_s=5.0,
                         peak_bytes=1 << 30, same_tokens_as_in_memory=True, streamed_bytes_per_token=3 << 30))  # fmt: skip
        rows.append(dict(common, side="accelerate", repeat=rep, rc=0, tokens_per_s=acc, ttft_s=6.0, load_s=4.0,
                         peak_bytes=2 << 30, same_tokens_as_in_memory=True))  # fmt: skip
        rows.append(dict(common, side="zero_inference", repeat=rep, rc=-9, error="  return func(*args, **kwargs)",
                         peak_bytes=2 << 30, oom_kills=1))  # fmt: skip
    return rows, ref, disk


def _summary(bench, tmp_path, rows, ref, disk):
    bench.write_summary(str(tmp_path), rows)  # from the rows alone
    return (tmp_path / "summary.md").read_text()


def test_each_side_its_row_and_each_baseline_its_ratio(bench, tmp_path):
    text = _summary(bench, tmp_path, *_rows())
    assert "| aidaptiv-ds generate | 0.550 (0.500-0.600) | 2.00 | 5.0 | 3.00 GiB |" in text
    assert "| accelerate disk offload | 0.225 (0.200-0.250) |" in text
    assert "**aidaptiv / accelerate disk offload tokens/s: 2.50x** (repeat pairs 2.00-3.00x)" in text
    # The killed baseline: said as killed by the cap, with its peak, and no ratio made up for it.
    assert "| DeepSpeed ZeRO-Inference (NVMe) | failed in 2 of 2 runs: 2 killed by the cap (out of memory) |" in text
    assert "return func" not in text and "aidaptiv / DeepSpeed ZeRO-Inference" not in text
    assert "memory cgroup of 2.00 GiB" in text and "GPU" not in text
    assert "`tinyllama-1.1b` shape, random weights, float32, 4.00 GiB of weights" in text
    assert "16 new tokens, 2 interleaved repeats" in text


def test_a_gpu_run_says_its_cap_and_an_uncapped_host(bench, tmp_path):
    text = _summary(bench, tmp_path, *_rows(device="cuda", cap=0))
    assert "each side's GPU memory capped at 1.50 GiB" in text
    assert "host memory NOT capped" in text
