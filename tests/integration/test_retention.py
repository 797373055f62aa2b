"""Retention (aidaptiv.retention_budget): the last layer groups of the forward stay in host memory until the
backward has used them. On the tiny preset (8 layer groups of up to 29.3 MiB, fp32) at the same 260 MiB host
budget (the least that retains 2 groups; it once ran out of a contiguous block for a gradient buffer, before
each reduce bucket's gradient buffers were taken as one block: SubGroupGradients.open_bucket), with and
without 60 MiB of retention (2 groups): identical losses, and the parameters' NVMe reads per step drop by at
least the retained groups' bytes (measured on the AMD EPYC dev machine: 100 MB per step for 59 MB retained;
the extra slots also keep more groups across the turn by LRU). The retention's slots come out of the
resident optimizer state (6 sub-groups resident without it, none with it)."""

import json
import os

from helpers import CONFIGS, failure_excerpt, read_metrics, run_train

STEPS, WARMUP = 3, 1


def run(tmp_path, name, retention):
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    swap = tmp_path / f"swap-{name}"
    swap.mkdir()
    cfg["aidaptiv"].update(
        nvme_path=str(swap), host_memory_budget="260MiB", layer_group_size=1, retention_budget=retention
    )
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / f"{name}-metrics.json"
    rc, log = run_train(
        [
            "--config",
            str(path),
            "--model",
            "tiny",
            "--seq-len",
            "64",
            "--micro-batch",
            "1",
            "--steps",
            str(STEPS),
            "--warmup",
            str(WARMUP),
            "--metrics-out",
            str(out),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, failure_excerpt(log)
    return read_metrics(out)


def test_retained_groups_are_not_read_again_and_losses_are_identical(tmp_path):
    off = run(tmp_path, "off", 0)
    on = run(tmp_path, "on", "60MiB")
    assert on["losses"] == off["losses"]  # fp32: the same bytes, only fewer reads
    s, s0 = on["swapper"], off["swapper"]
    assert s0["retained_bytes"] == 0 and s0["retention_hits"] == 0
    assert s["retained_groups"] == 2 and 2 * 28 * 2**20 < s["retained_bytes"] <= 60 * 2**20
    steps = STEPS + WARMUP  # the counters are cumulative over every step
    drop_per_step = (s0["group_read_bytes"] - s["group_read_bytes"]) / steps
    assert drop_per_step >= s["retained_bytes"] * 0.95
    # Every backward found the retained groups it used in memory: the reads avoided are their bytes.
    assert s["retention_hits"] >= steps
    assert s["retention_avoided_read_bytes"] >= steps * s["retained_bytes"] / 2
    assert "last 2 layer groups retained" in s["plan"]
