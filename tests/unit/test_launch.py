"""The launch command of a cell, as the contract with aidaptiv_ds/job/train.py spells it."""

import pytest

from aidaptiv_ds.harness.grid import Cell
from aidaptiv_ds.harness.launch import LaunchSpec, launch_command, train_spec

CELL = Cell("llama3.1-8b", "aidaptiv", 2, 18, 12000, 10)


def cmd(spec, **kw):
    kw.setdefault("gpu_mem_cap_gb", None)
    return launch_command(
        CELL, spec, port=29600, swap_dir="/nvme/cell/swap", metrics_out="/out/c/metrics.json", steps=4, warmup=1, **kw
    )


def test_cpu_command_matches_the_contract():
    c = cmd(LaunchSpec(ds_configs="/repo/ds_configs"))
    assert c == [
        "deepspeed",
        "--num_accelerators",
        "2",
        "--master_port",
        "29600",
        "--no_local_rank",
        "--module",
        "aidaptiv_ds",
        "train",
        "--config",
        "/repo/ds_configs/aidaptiv.json",
        "--model",
        "llama3.1-8b",
        "--seq-len",
        "12000",
        "--micro-batch",
        "18",
        "--grad-accum",
        "10",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--nvme-path",
        "/nvme/cell/swap",
        "--metrics-out",
        "/out/c/metrics.json",
    ]


def test_gpu_cap_is_passed_to_train():
    c = cmd(LaunchSpec(), gpu_mem_cap_gb=40.0)
    assert c[-2:] == ["--gpu-mem-cap-gb", "40"]


def test_cuda_with_visible_devices_uses_include():
    c = cmd(LaunchSpec(accelerator="cuda", visible_devices="2,3,5"))
    assert c[1:3] == ["--include", "localhost:2,3"]
    assert "--num_accelerators" not in c and "--num_gpus" not in c
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        cmd(LaunchSpec(accelerator="cuda", visible_devices="0"))


def test_cuda_without_visible_devices_counts():
    c = cmd(LaunchSpec(accelerator="cuda"))
    assert c[1:3] == ["--num_accelerators", "2"]


def test_multinode_uses_the_hostfile():
    spec = LaunchSpec(
        accelerator="cuda", hostfile="/job/hostfile", gpus_per_node=1, master_addr="node001", ds_launcher="pdsh"
    )
    c = cmd(spec)
    assert c[: c.index("--master_port")] == [
        "deepspeed",
        "--hostfile",
        "/job/hostfile",
        "--num_nodes",
        "2",
        "--num_gpus",
        "1",
        "--master_addr",
        "node001",
        "--launcher",
        "pdsh",
    ]
    # A rank on another node has no swap folder: the sweep made it on its own node only; train makes it there.
    assert c[c.index("--nvme-path") : c.index("--nvme-path") + 3] == [
        "--nvme-path",
        "/nvme/cell/swap",
        "--create-nvme-path",
    ]
    one_node = LaunchSpec(hostfile="/job/hostfile", gpus_per_node=8)
    c = cmd(one_node)
    assert c[1:7] == ["--hostfile", "/job/hostfile", "--num_nodes", "1", "--num_gpus", "2"]
    with pytest.raises(ValueError, match="do not split evenly"):
        launch_command(
            Cell("tiny", "zero3", 3, 1, 8, 1),
            LaunchSpec(hostfile="h", gpus_per_node=2),
            port=1,
            swap_dir="s",
            metrics_out="m",
            steps=2,
            warmup=1,
        )


def test_train_module_override(monkeypatch):
    monkeypatch.delenv("AIDAPTIV_DS_TRAIN_MODULE", raising=False)
    assert train_spec() == "aidaptiv_ds train"
    monkeypatch.setenv("AIDAPTIV_DS_TRAIN_MODULE", "fake_train")
    assert train_spec() == "fake_train"
    assert train_spec("other.mod --flag") == "other.mod --flag"
    c = cmd(LaunchSpec(train="pkg.fake --quiet"))
    i = c.index("--module")
    assert c[i + 1 : i + 4] == ["pkg.fake", "--quiet", "--config"]


def test_deepspeed_slurm_launcher_gets_the_module_as_a_script(tmp_path):
    """DeepSpeed 0.19.8's slurm launcher drops --module (srun runs `python -u <script>`): the module goes after
    `--` as the script `-m`, so srun runs `python -u -m aidaptiv_ds train` (run on a real cluster in
    tests/cluster/test_cluster.py)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n\n# spare\nnode3 slots=1\n")
    gpu = cmd(LaunchSpec(accelerator="cuda", hostfile=str(hostfile), gpus_per_node=1, ds_launcher="slurm"))
    assert gpu[gpu.index("--no_local_rank") + 1 : gpu.index("--no_local_rank") + 6] == [
        "--",
        "-m",
        "aidaptiv_ds",
        "train",
        "--config",
    ]
    assert "--module" not in gpu and gpu[gpu.index("--num_gpus") + 1] == "1"
    # On CPU nodes no --num_gpus (srun would ask for --gpus-per-node, which a cluster without GPUs refuses):
    # the nodes and ranks are named with --include from the hostfile.
    cpu = cmd(LaunchSpec(hostfile=str(hostfile), gpus_per_node=1, ds_launcher="slurm"))
    assert cpu[cpu.index("--include") + 1] == "node1:0@node2:0"
    assert "--num_gpus" not in cpu and "--num_nodes" not in cpu
    two_per_node = cmd(LaunchSpec(hostfile=str(hostfile), gpus_per_node=2, ds_launcher="slurm"))
    assert two_per_node[two_per_node.index("--include") + 1] == "node1:0,1"
    # pdsh keeps --module and --num_gpus
    pdsh = cmd(LaunchSpec(hostfile=str(hostfile), gpus_per_node=1, ds_launcher="pdsh"))
    assert "--module" in pdsh and "--num_gpus" in pdsh and "--include" not in pdsh
    with pytest.raises(ValueError, match="needs 2 nodes"):
        hostfile.write_text("node1 slots=1\n")
        cmd(LaunchSpec(hostfile=str(hostfile), gpus_per_node=1, ds_launcher="slurm"))
