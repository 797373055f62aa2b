"""The free-space check at ``initialize`` counts every rank of the node: they all swap to the same disk."""

import os

import pytest
import torch

from aidaptiv_ds.common.sizes import SWAP_FILE_GROW_STEP
from aidaptiv_ds.config import resolve as C
from aidaptiv_ds.zero3.initialize import needed_swap_bytes


def _cfg(path):
    return {"zero_optimization": {"stage": 3}, "aidaptiv": {"enabled": True, "nvme_path": str(path)}}


def test_need_is_per_node_not_per_rank(tmp_path, monkeypatch):
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters, fp32: 16 bytes each on the swap disk
    per_rank = 16 * -(-1_001_000 // 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the deepspeed launcher: 4 of the 8 ranks on this node
    assert needed_swap_bytes(model, _cfg(tmp_path), world_size=8) == 4 * per_rank
    assert needed_swap_bytes(model, _cfg(tmp_path), world_size=8, local_ranks=2) == 2 * per_rank
    # More local ranks than the world (a stale environment) is the world.
    assert needed_swap_bytes(model, _cfg(tmp_path), world_size=2, local_ranks=4) == 2 * 16 * 500_500


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


def test_the_check_counts_what_the_planner_lays_out(tmp_path):
    """fp32: the parameter is its own master (16 bytes: parameter, gradient, two moments); the check counted 20
    and refused runs whose swap files fit (a 3B model: 61.7 GB asked for 49.4 GB of files)."""
    from aidaptiv_ds.planner.memory import Hardware, Job, plan_backend
    from aidaptiv_ds.planner.shapes import resolve_shape

    shape = resolve_shape("small")
    for dtype, cfg in (("fp32", _cfg(tmp_path)), ("bf16", dict(_cfg(tmp_path), bf16={"enabled": True}))):
        plan = plan_backend(
            "aidaptiv", Job(shape, 64, 1, dtype=dtype, host_budget=1 << 30), Hardware(gpus=1, host_mem=1 << 40)
        )
        model = torch.nn.Linear(1000, 1000)
        need = needed_swap_bytes(model, cfg, world_size=1, local_ranks=1)
        # The model state (the files' growth steps, up to 256 MiB each, are not per parameter)
        state = sum(v for k, v in plan.nvme.items() if not k.startswith("swap files' growth"))
        assert 0 < plan.nvme_bytes - state <= 3 * SWAP_FILE_GROW_STEP
        per_param = state / shape.num_parameters
        assert need / 1_001_000 == pytest.approx(per_param, rel=0.01), (dtype, need / 1_001_000, per_param)


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


def test_a_frozen_parameter_needs_only_its_own_bytes(tmp_path, monkeypatch):
    # A LoRA base is streamed read-only: no gradient, master copy or moments on the disk for it. A 7B base
    # counted at 20 bytes a parameter would ask 140 GB of a disk that holds its 28 GB.
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    base, adapter = torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 8, bias=False)
    base.requires_grad_(False)
    model = torch.nn.Sequential(base, adapter)
    need = needed_swap_bytes(model, _cfg(tmp_path), world_size=1, local_ranks=1)
    assert need == 4 * 1_001_000 + 16 * 8_000
    bf16 = dict(_cfg(tmp_path), bf16={"enabled": True})
    assert needed_swap_bytes(model, bf16, world_size=1, local_ranks=1) == 2 * 1_001_000 + 18 * 8_000


def test_launch_guard_counts_a_lora_base_at_its_own_bytes(tmp_path):
    from aidaptiv_ds.planner.guard import launch_problems
    from aidaptiv_ds.planner.shapes import resolve_shape

    shape = resolve_shape("llama2-7b")
    cfg = {
        "zero_optimization": {"stage": 3},
        "aidaptiv": {"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "2GiB"},
    }
    base = 4 * shape.num_parameters  # fp32
    common = dict(world_size=1, local_world_size=1, seq_len=128, micro_batch=1, cuda=False, ram_bytes=16 << 30)
    roomy = launch_problems(shape, cfg, disk_free=lambda p: base + (1 << 30), lora=True, **common)
    assert roomy == []  # full fine-tuning's 20 bytes a parameter would refuse this disk
    assert any("swap space" in p for p in launch_problems(shape, cfg, disk_free=lambda p: base + (1 << 30), **common))
    short = launch_problems(shape, cfg, disk_free=lambda p: base // 2, lora=True, **common)
    assert len(short) == 1 and "frozen base of llama2-7b" in short[0] and "GiB free" in short[0]
    zero3 = {"zero_optimization": {"stage": 3}}
    in_ram = launch_problems(shape, zero3, disk_free=lambda p: 0, lora=True, **common)
    assert len(in_ram) == 1 and "host memory" in in_ram[0] and "use aidaptiv" in in_ram[0]
