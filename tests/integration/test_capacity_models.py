"""bench/capacity_models.py, the capacity-by-model-size sweep, on a short real ladder: under a 2 GiB cap stock
ZeRO-3 trains micro and is killed by the cap on tiny, aidaptiv trains both and is stopped by the disk on a 70B
shape (never started: its swap would not fit any disk here); a second run reuses every row but the disk
refusal, and a row made with another host budget is not reused. The full table
(tiny to 13B under 8 GiB) is the bench's own run, committed under bench/results/capacity_models/cap_8gib."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, child_env

from aidaptiv_ds.harness.hostcap import probe_cgroup

BENCH = os.path.join(REPO, "bench", "capacity_models.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("capacity_models", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_zero_infinity_alone_finds_its_shipped_config(bench, tmp_path):
    """--variants zero_infinity without zero_infinity_eqmem: the documented config is built from the shipped file
    in zero_infinity's own folder (it looked only in eqmem's, a KeyError)."""
    import argparse

    args = argparse.Namespace(
        variants=["zero_infinity"], ds_configs=os.path.join(REPO, "ds_configs"), out=str(tmp_path)
    )
    runner = bench.Runner.__new__(bench.Runner)  # the config folders only: no cgroup, no prebuild
    runner.folders, runner.flags = bench.Runner.write_configs(args)
    assert runner._zi_base()["zero_optimization"]["offload_param"]["device"] == "nvme"


def test_climb_stops_at_the_first_size_that_does_not_train(bench):
    tried = []

    def attempt(model):
        tried.append(model)
        return {"model": model, "fits": model != "c"}

    largest, stopped, rows = bench.climb(["a", "b", "c", "d"], attempt)
    assert (largest, stopped["model"], tried) == ("b", "c", ["a", "b", "c"])
    largest, stopped, rows = bench.climb(["c", "d"], attempt)
    assert (largest, stopped["model"], len(rows)) == (None, "c", 1)
    assert bench.climb(["a", "b"], attempt)[:2] == ("b", None)


def test_disk_refusal_counts_the_swap_bytes_of_the_mode(bench):
    params = 3_000_000_000
    assert bench.swap_bytes_needed("zero3", "full", params) == 0  # in memory: never refused for the disk
    assert bench.disk_refusal("zero3", "full", params, free_bytes=1) is None
    assert bench.swap_bytes_needed("aidaptiv", "full", params) == 16 * params
    assert bench.swap_bytes_needed("zero_infinity", "lora", params) == 4 * params
    # 48 GB of full fine-tuning state does not fit 40 GB free; 12 GB of a LoRA base does
    why = bench.disk_refusal("aidaptiv", "full", params, free_bytes=40 * 10**9)
    assert "40.0 GB free" in why and "48.0 GB" in why
    assert bench.disk_refusal("aidaptiv", "lora", params, free_bytes=40 * 10**9) is None
    # the margin is kept: exactly the swap bytes free is not enough
    assert bench.disk_refusal("aidaptiv", "lora", params, free_bytes=4 * params) is not None


FACTORY, WHERE = probe_cgroup()


@pytest.mark.long("bench/capacity_models.py runs the ladder; the climb and the disk refusal are tested above")
@pytest.mark.skipif(FACTORY is None, reason=f"needs a memory cgroup to cap the cells: {WHERE}")
def test_short_ladder_under_a_cap(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, BENCH, "--models", "micro,tiny,llama2-70b", "--variants", "zero3,aidaptiv", "--modes",
           "full", "--host-mem-cap-gb", "2", "--host-budget", "256MiB", "--out", str(out), "--no-prebuild"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = {(r["variant"], r["model"]): r for r in map(json.loads, open(out / "rows.jsonl"))}
    assert set(rows) == {("zero3", "micro"), ("zero3", "tiny"), ("aidaptiv", "micro"), ("aidaptiv", "tiny"),
                         ("aidaptiv", "llama2-70b")}  # fmt: skip
    assert rows["zero3", "micro"]["fits"] and rows["aidaptiv", "micro"]["fits"] and rows["aidaptiv", "tiny"]["fits"]
    assert rows["zero3", "tiny"]["status"] == "oom" and not rows["zero3", "tiny"]["fits"]
    assert rows["aidaptiv", "llama2-70b"]["status"] == "disk" and "GB free" in rows["aidaptiv", "llama2-70b"]["error"]
    assert all(len(rows[k]["losses"]) == 2 for k in rows if rows[k]["fits"])
    summary = (out / "summary.md").read_text()
    assert "| full | zero3 | micro |" in summary and "tiny: oom" in summary
    assert "| full | aidaptiv | tiny |" in summary and "llama2-70b: disk" in summary
    # a second run trains nothing: every trained or killed attempt has its row; the disk refusal is checked again
    # (space may have been freed), which starts nothing either
    p = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stderr.count("row kept from an earlier run") == 4, p.stderr[-3000:]
    assert "llama2-70b: disk" in p.stderr and len(open(out / "rows.jsonl").read().splitlines()) == 6
    # a row made with another host budget is not this cell's: micro is trained again under 512 MiB
    cmd[cmd.index("256MiB")] = "512MiB"
    cmd[cmd.index("micro,tiny,llama2-70b")] = "micro"
    p = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "full aidaptiv micro: trained [" in p.stderr, p.stderr[-3000:]
    assert (
        "full aidaptiv micro: trained [row kept" not in p.stderr and "full zero3 micro: trained [row kept" in p.stderr
    )
