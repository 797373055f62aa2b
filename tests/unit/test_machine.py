"""Machine facts recorded in rows."""

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
