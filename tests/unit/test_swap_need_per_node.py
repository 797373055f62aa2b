"""The free-space check at ``initialize`` counts every rank of the node: they all swap to the same disk."""

import os

import pytest
import torch

from aidaptiv_ds.config import resolve as C
from aidaptiv_ds.zero3.initialize import needed_swap_bytes


def _cfg(path):
    return {"zero_optimization": {"stage": 3}, "aidaptiv": {"enabled": True, "nvme_path": str(path)}}


def test_need_is_per_node_not_per_rank(tmp_path, monkeypatch):
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters, fp32: 20 bytes each with Adam
    per_rank = 20 * -(-1_001_000 // 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the deepspeed launcher: 4 of the 8 ranks on this node
    assert needed_swap_bytes(model, _cfg(tmp_path), world_size=8) == 4 * per_rank
    assert needed_swap_bytes(model, _cfg(tmp_path), world_size=8, local_ranks=2) == 2 * per_rank
    # More local ranks than the world (a stale environment) is the world.
    assert needed_swap_bytes(model, _cfg(tmp_path), world_size=2, local_ranks=4) == 2 * 20 * 500_500


def test_what_the_node_already_wrote_is_not_counted_twice(tmp_path, monkeypatch):
    # zero.Init wrote the parameters of two ranks before initialize checks: those bytes are already taken
    # from the free space.
    model = torch.nn.Linear(1000, 1000)
    base = needed_swap_bytes(model, _cfg(tmp_path), world_size=2, local_ranks=2)
    for rank in (0, 1):
        folder = tmp_path / "aidaptiv-swap" / f"rank{rank}" / "p1-0"
        folder.mkdir(parents=True)
        with open(folder / "params.swp", "wb") as f:
            f.write(b"\1" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    written = sum(
        os.lstat(tmp_path / "aidaptiv-swap" / f"rank{r}" / "p1-0" / "params.swp").st_blocks * 512 for r in (0, 1)
    )
    assert written >= 2 << 20
    assert needed_swap_bytes(model, _cfg(tmp_path), world_size=2, local_ranks=2) == base - written


def test_refusal_names_the_node(tmp_path):
    with pytest.raises(C.ConfigError) as err:
        C.validate(_cfg(tmp_path), needed_bytes=1 << 60)
    text = str(err.value)
    assert "GiB free but the model state needs" in text and "on this node" in text


def test_launch_guard_counts_the_ranks_of_the_node(tmp_path):
    from aidaptiv_ds.planner.guard import launch_problems
    from aidaptiv_ds.planner.memory import Hardware, Job, plan_backend
    from aidaptiv_ds.planner.shapes import resolve_shape

    shape = resolve_shape("small")
    cfg = {
        "zero_optimization": {"stage": 3},
        "aidaptiv": {"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "1GiB"},
    }
    job = Job(shape, 64, 1, dtype="fp32", host_budget=1 << 30)
    per_rank = plan_backend("aidaptiv", job, Hardware(gpus=2, host_mem=1 << 40)).nvme_bytes
    free = int(1.5 * per_rank)  # room for one rank's share, not for two
    common = dict(world_size=2, seq_len=64, micro_batch=1, cuda=False, ram_bytes=1 << 40, disk_free=lambda p: free)
    two = launch_problems(shape, cfg, local_world_size=2, **common)
    assert any("swap space" in p and "2 rank(s) on this node" in p for p in two), two
    assert not [p for p in launch_problems(shape, cfg, local_world_size=1, **common) if "swap space" in p]
