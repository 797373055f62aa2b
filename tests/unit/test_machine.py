"""Machine facts: the readers in engine/machine.py and engine/disk.py, and the machine block rows record."""

import os

from aidaptiv_ds.engine.disk import disk_of
from aidaptiv_ds.harness.machine import cpu_line, machine_info, summary


def test_machine_info_has_the_row_fields(tmp_path):
    m = machine_info(str(tmp_path / "not" / "yet" / "swap"))
    for k in ("host", "cpu", "cores", "ram_gb", "gpus", "kernel", "swap_disk"):
        assert k in m
    assert m["cores"] >= 1 and m["ram_gb"] > 0 and m["kernel"] == os.uname().release
    d = m["swap_disk"]
    assert d["path"].endswith("not/yet/swap")  # a folder that does not exist yet still resolves
    assert d["mount"] and d["filesystem"]  # via its nearest existing parent


def test_disk_of_a_block_device_backed_path():
    d = disk_of("/")
    assert d["mount"] == "/"
    if d["device"] is not None:  # overlay roots (containers) have none
        assert d["rotational"] in (True, False)
        assert os.path.exists(f"/sys/block/{d['device']}")


def test_summary_line():
    m = {
        "host": "n1",
        "cpu": "Xeon",
        "cores": 48,
        "ram_gb": 192.0,
        "kernel": "5.15",
        "gpus": [{"name": "A100-PCIE-40GB", "memory_mb": 40960.0}] * 2,
        "swap_disk": {"device": "nvme0n1", "model": "AI100E", "rotational": False, "filesystem": "xfs"},
    }
    assert summary(m) == (
        "n1: Xeon (flags not recorded), 48 cores, 192.0 GiB RAM, 2x A100-PCIE-40GB 40 GiB, kernel 5.15, "
        "swap disk nvme0n1 (AI100E, non-rotational, xfs)"
    )


def test_the_machine_line_names_the_cpu_flags_that_change_results():
    m = machine_info("/tmp")
    assert "cpu_flags" in m  # the row keeps them all
    epyc = {"cpu": "AMD EPYC 7B13", "cpu_flags": ["sse2", "avx", "avx2", "fma", "f16c"]}
    xeon = {
        "cpu": "Intel Xeon",
        "cpu_flags": ["avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16"],
    }
    assert cpu_line(epyc) == ("AMD EPYC 7B13 (avx avx2 fma f16c; no avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16)")
    assert cpu_line(xeon) == "Intel Xeon (avx avx2 fma f16c avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16)"
    assert cpu_line({"cpu": "Neoverse", "cpu_flags": ["fp", "asimd", "sve"]}) == "Neoverse (asimd sve; no bf16)"
    assert summary(dict(epyc, host="n2")).startswith("n2: AMD EPYC 7B13 (avx avx2 fma f16c; no avx512f")


def test_gpus_and_the_driver_come_from_one_nvidia_smi_reader(tmp_path, monkeypatch):
    from aidaptiv_ds.engine import machine

    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  *driver_version*) echo "550.54.15"; echo "550.54.15" ;;\n'
        '  *) echo "NVIDIA H200, 143771"; echo "NVIDIA H200, [N/A]" ;;\n'
        "esac\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine.gpus() == [
        {"name": "NVIDIA H200", "memory_mb": 143771.0},
        {"name": "NVIDIA H200, [N/A]", "memory_mb": None},
    ]
    assert machine.nvidia_driver() == "550.54.15"
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert machine.gpus() == [] and machine.nvidia_driver() is None


def test_the_mount_table_unescapes_names_and_keeps_options():
    from aidaptiv_ds.engine.disk import mount_table

    table = mount_table(
        "/dev/sdb1 /mnt/with\\040space ext4 rw,relatime 0 0\ncgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
    )
    assert table[0] == {
        "source": "/dev/sdb1",
        "mountpoint": "/mnt/with space",
        "fstype": "ext4",
        "options": "rw,relatime",
    }
    assert "memory" in table[1]["options"].split(",")


def test_the_disk_facts_refuse_a_memory_filesystem_as_io_bench_does(tmp_path, monkeypatch):
    from aidaptiv_ds.engine import disk

    # env once checked O_DIRECT against /proc/self/mountinfo, which check_dir cannot parse, and said "works"
    # for a folder on tmpfs (which takes O_DIRECT on recent kernels) where io-bench and the planner refuse it.
    monkeypatch.setattr(disk, "read_mounts", lambda: f"tmpfs {tmp_path} tmpfs rw 0 0\n")
    facts = disk.disk_facts(str(tmp_path / "swap"))
    assert facts["o_direct"].startswith(f"{tmp_path} is on tmpfs (memory, not a disk)")
    assert facts["filesystem"] == "tmpfs" and facts["free_gb"] is not None
