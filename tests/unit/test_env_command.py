"""`aidaptiv-ds env`: the facts a bug report needs, about this machine, as text and as JSON."""

from __future__ import annotations

import json

from aidaptiv_ds import cli


def test_env_reports_versions_engine_disk_and_limits(tmp_path, capsys):
    swap = tmp_path / "not-yet" / "swap"  # not made yet: its nearest existing parent is described
    assert cli.main(["env", "--json", "--nvme-path", str(swap)]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["packages"]["aidaptiv-ds"] and facts["packages"]["torch"] and facts["packages"]["deepspeed"]
    assert facts["engine"]["built"] is True and facts["engine"]["alignment"] == 4096
    # The engine's compiler and C++ string ABI beside torch's (the ABI must agree, or the engine refuses to load).
    assert facts["engine"]["compiler"] and facts["torch"]["compiler"].startswith(("GCC", "Clang", "clang"))
    assert facts["engine"]["cxx11_abi"] == facts["torch"]["cxx11_abi"]
    assert facts["swap_disk"]["path"] == str(swap) and facts["swap_disk"]["free_gb"] > 0
    from aidaptiv_ds.engine.disk import MEMORY_FILESYSTEMS

    if facts["swap_disk"]["filesystem"] not in MEMORY_FILESYSTEMS:  # a /tmp on tmpfs refuses O_DIRECT
        assert facts["swap_disk"]["o_direct"] == "works"
    assert set(facts["limits"]) == {"memlock", "open_files", "file_size"}
    assert facts["memory"]["ram_gib"] > 0 and facts["cpu"]["cores"] >= 1
    assert "file" in facts["cached_rates"]
    if facts["swap_disk"]["device"]:  # a block device: its request limits (how I/O pieces are split)
        assert facts["swap_disk"]["max_segments"] > 0 and facts["swap_disk"]["max_sectors_kb"] > 0


def test_env_says_whether_the_pinned_pool_gets_huge_pages(tmp_path):
    from aidaptiv_ds.engine.machine import huge_page_facts

    for text, mode, pages in (
        ("always [madvise] never\n", "madvise", "2 MiB huge pages"),
        ("[always] madvise never\n", "always", "2 MiB huge pages"),
        ("always madvise [never]\n", "never", "4 KiB pages"),
    ):
        f = tmp_path / "enabled"
        f.write_text(text)
        facts = huge_page_facts(str(f))
        assert facts["transparent_huge_pages"] == mode and facts["pinned_pool_pages"].startswith(pages)
    missing = huge_page_facts(str(tmp_path / "absent"))
    assert missing["transparent_huge_pages"] is None and "set " in missing["pinned_pool_pages"]


def test_env_text_says_where_o_direct_fails(tmp_path, capsys, monkeypatch):
    from aidaptiv_ds.engine import disk

    def refuse(path, mounts_text=None):
        raise disk.UnsuitableDisk(f"{path} is on tmpfs (memory, not a disk)")

    monkeypatch.setattr(disk, "check_dir", refuse)
    assert cli.main(["env", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"o_direct: {tmp_path} is on tmpfs" in out and "packages:" in out and "limits:" in out


def test_an_engine_built_with_another_cxx_string_abi_than_torch_is_refused_at_import():
    import subprocess
    import sys

    code = (
        "import torch\n"
        "torch._C._GLIBCXX_USE_CXX11_ABI = not torch._C._GLIBCXX_USE_CXX11_ABI\n"
        "import aidaptiv_ds.engine.io\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "ImportError" in p.stderr, p.stderr[-2000:]
    assert "_GLIBCXX_USE_CXX11_ABI" in p.stderr and "rebuild the engine" in p.stderr, p.stderr[-2000:]
