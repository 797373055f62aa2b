"""bench/generate_moe.py's summary, from its rows alone: a table per router, ratios of the routed side against
dense streaming and accelerate from the repeats they shared (with the issue's targets beside them), the bytes
read per token against the bound (the experts decoding missed in the cache, plus the layers streamed), the hit
rate said to be the worst case under uniform routing, and a side the cap killed said as such."""

import importlib.util
import os

import pytest
from helpers import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("generate_moe", os.path.join(REPO, "bench", "generate_moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows():
    common = {"machine": "test machine", "shape": "olmoe-mini", "config": {"num_experts": 64}, "dtype": "bfloat16",
              "weight_bytes": 4 << 30, "budget_bytes": 1 << 30, "cap_bytes": 2 << 30, "new_tokens": 9,
              "zipf_s": 1.0, "git_sha": "abc", "command": "python bench/generate_moe.py --shape olmoe-mini"}  # fmt: skip
    experts = {"layers": 8, "top_k": 8, "experts": 512, "cache_slots": 100, "slot_bytes": 1 << 20,
               "read_from": "model", "active_bytes_per_token": 64 << 20}  # fmt: skip
    rows = [dict(common, side="disk", router=None, repeat=0, rc=0, file_mb=2048, read_gbps=2.0)]
    for router, hit in (("uniform", 0.25), ("zipf", 0.5)):
        rows.append(dict(common, side="in_memory", router=router, repeat=0, rc=0, token_ids=[1], tokens_per_s=20.0,
                         ttft_s=0.5, decode_s=0.4, new_tokens=9))  # fmt: skip
        for rep, (ours, whole, acc) in enumerate([(4.0, 0.5, 0.2), (5.0, 1.0, 0.25)]):
            rows.append(dict(common, side="aidaptiv", router=router, repeat=rep, rc=0, tokens_per_s=ours, ttft_s=2.0,
                             layout_s=0.1, peak_bytes=1 << 30, same_tokens_as_in_memory=True,
                             decode_bytes_per_token=(1 - hit) * (64 << 20) * 1.01, decode_expert_hit_rate=hit,
                             bound_bytes_per_token=(1 - hit) * (64 << 20), active_bytes_per_token=64 << 20,
                             streamed_bytes_per_pass=0, experts=experts))  # fmt: skip
            rows.append(dict(common, side="aidaptiv_whole", router=router, repeat=rep, rc=0, tokens_per_s=whole,
                             ttft_s=3.0, layout_s=5.0, peak_bytes=1 << 30, same_tokens_as_in_memory=True,
                             decode_bytes_per_token=3 << 30, decode_expert_hit_rate=None))  # fmt: skip
            rows.append(dict(common, side="accelerate", router=router, repeat=rep, rc=-9, error="  return f(x)",
                             peak_bytes=2 << 30, oom_kills=1))  # fmt: skip
    return rows


def test_each_router_its_table_ratios_and_bound(bench, tmp_path):
    bench.write_summary(str(tmp_path), _rows())
    text = (tmp_path / "summary.md").read_text()
    assert "**Routers: uniform**" in text and "**Routers: zipf**" in text
    assert "| aidaptiv-ds generate (routed experts, --experts-from auto) | 4.500 (4.000-5.000) | 2.00 | 0.1 | " in text
    assert "| 25% | 1.00 GiB | True |" in text and "| 50% | 1.00 GiB | True |" in text
    # Dense streaming: pairs 8x and 5x; accelerate failed in every run, killed by the cap: no ratio made up.
    assert "**routed / aidaptiv-ds generate --experts whole (dense streaming) tokens/s: 6.50x** (repeat pairs " in text
    assert "5.00-8.00x; target >= 4x)." in text
    assert "| accelerate disk offload | failed in 2 runs: 2 killed by the cap |" in text
    assert "routed / accelerate" not in text and "return f" not in text
    assert "**1.010x the bound** (target <= 1.3x)" in text
    assert "hit rate 25% while decoding (uniform routing: the worst case for a cache)" in text
    assert "hit rate 50% while decoding." in text and "Machine: test machine; git abc." in text
