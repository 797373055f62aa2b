"""The one rule for a swap folder (aidaptiv_ds.engine.disk.swap_folder_problem), as every command that takes one
applies it: it exists (a job makes it only when told: train's --create-nvme-path, or DeepSpeed's own swapper), it
is a directory, on a disk that takes O_DIRECT (not tmpfs or ramfs), and it takes a file, which a read-only mount
refuses even to root. The checks make nothing and leave nothing behind."""

import os
import subprocess
import sys

import pytest

from aidaptiv_ds import cli
from aidaptiv_ds.common import destinations
from aidaptiv_ds.engine import disk

SHM = "/dev/shm" if os.path.isdir("/dev/shm") and disk.mount_of("/dev/shm")["fstype"] == "tmpfs" else None


def test_a_missing_folder_is_refused_unless_the_job_makes_it_and_nothing_is_made(tmp_path):
    missing = tmp_path / "swap" / "cell"
    said = disk.swap_folder_problem(str(missing))
    assert (
        said == f"{missing} does not exist: create it on the SSD (mkdir -p {missing}) or choose an existing directory"
    )
    assert disk.swap_folder_problem(str(missing), made_by_job=True) is None  # its parent takes files
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert disk.swap_folder_problem(str(a_file)) == f"{a_file} is not a directory: give a directory on the SSD"
    assert disk.swap_folder_problem(str(a_file / "swap"), made_by_job=True) == (
        f"{a_file}/swap cannot be made because {a_file} is a file, not a directory: give a path under a directory"
    )
    assert disk.swap_folder_problem(str(tmp_path)) is None
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_memory_is_refused_by_the_mount_table_even_where_it_takes_o_direct(tmp_path):
    mounts = f"tmpfs {tmp_path} tmpfs rw 0 0\n"  # tmpfs takes O_DIRECT on kernels from 6.6: memory all the same
    said = disk.swap_folder_problem(str(tmp_path), mounts_text=mounts)
    assert said.startswith(f"{tmp_path} is on tmpfs (memory, not a disk): swap files need a disk that takes O_DIRECT")
    said = disk.swap_folder_problem(str(tmp_path / "new"), made_by_job=True, mounts_text=mounts)
    assert said.startswith(f"{tmp_path}/new would be made in {tmp_path}, which is on tmpfs (memory, not a disk)")


def test_the_probe_leaves_nothing_where_the_file_system_has_no_unnamed_files(tmp_path, monkeypatch):
    destinations.probe(str(tmp_path), direct=True)
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)  # the named file instead, unlinked at once
    destinations.probe(str(tmp_path), direct=True)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root passes permission bits: the read-only mount test covers root")
def test_a_folder_without_write_permission_is_refused(tmp_path):
    tmp_path.chmod(0o500)
    try:
        said = disk.swap_folder_problem(str(tmp_path))
    finally:
        tmp_path.chmod(0o700)
    assert said == f"{tmp_path} is not writable (EACCES): choose a directory you own or fix its permissions"


def test_a_read_only_mount_is_refused_even_to_root(tmp_path):
    """EROFS, in a mount namespace of its own with the folder bind-mounted read-only (skipped where the kernel or
    sandbox refuses user and mount namespaces)."""
    from helpers import REPO, read_only_mount

    wrap = read_only_mount(tmp_path)
    if not wrap:
        pytest.skip("no user and mount namespace this Python runs in here: EROFS cannot be made without privilege")
    code = "import sys\nfrom aidaptiv_ds.engine import disk\nprint(disk.swap_folder_problem(sys.argv[1]))\n"
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([*wrap, sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        f"{tmp_path} is on a read-only file system (EROFS): remount it read-write or choose a directory on a "
        "writable disk"
    )


@pytest.mark.parametrize("kind", ["missing", "tmpfs"])
def test_every_command_that_takes_a_swap_folder_says_the_same_sentence(tmp_path, capsys, kind):
    """generate (tests/integration/test_generate.py runs it), train, plan and io-bench: one rule, one sentence."""
    if kind == "tmpfs" and SHM is None:
        pytest.skip("no tmpfs at /dev/shm")
    folder = str(tmp_path / "swap") if kind == "missing" else SHM
    sentence = f"--nvme-path {disk.swap_folder_problem(folder)}"
    assert cli.main(["io-bench", "--nvme-path", folder, "--size-mb", "8"]) == 2
    assert sentence in capsys.readouterr().err
    assert cli.main(["plan", "--model", "micro", "--seq-len", "64", "--micro-batch", "1", "--nvme-path", folder]) == 1
    assert sentence in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "swap")
