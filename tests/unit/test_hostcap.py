"""Finding where cell cgroups can be made (on fake cgroup trees), and reading a cgroup's counters."""

import os

from aidaptiv_ds.harness.hostcap import CellCgroup, _probe_v1, _probe_v2

# /proc/self/mounts lines (a v1 hierarchy's controllers are among its options).
V2_MOUNTS = "cgroup2 {mnt} cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
V1_MOUNTS = "cgroup {mnt} cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0\n"


def _tree(root, spec):
    for rel, subtree in spec.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.subtree_control").write_text(subtree)


def test_v2_uses_the_nearest_ancestor_that_delegates_memory(tmp_path):
    _tree(tmp_path, {".": "cpu io memory pids", "user.slice": "cpu memory", "user.slice/session-1.scope": ""})
    f, where = _probe_v2(V2_MOUNTS.format(mnt=tmp_path), "0::/user.slice/session-1.scope\n")
    assert f is not None and f.kind == "cgroup2"
    assert os.path.normpath(f.parent) == str(tmp_path / "user.slice")


def test_v2_own_cgroup_when_it_delegates(tmp_path):
    _tree(tmp_path, {".": "memory", "job": "memory"})
    f, _ = _probe_v2(V2_MOUNTS.format(mnt=tmp_path), "0::/job\n")
    assert os.path.normpath(f.parent) == str(tmp_path / "job")


def test_v2_without_memory_controller(tmp_path):
    _tree(tmp_path, {".": "cpu", "a": ""})
    f, why = _probe_v2(V2_MOUNTS.format(mnt=tmp_path), "0::/a\n")
    assert f is None and "no memory controller" in why
    f, why = _probe_v2("", "0::/a\n")
    assert f is None and "no cgroup2 mount" in why


def test_v1_uses_our_own_memory_cgroup(tmp_path):
    (tmp_path / "process_api" / "abc").mkdir(parents=True)
    f, where = _probe_v1(V1_MOUNTS.format(mnt=tmp_path), "4:memory:/process_api/abc\n0::/\n")
    assert f.kind == "cgroup1" and where == str(tmp_path / "process_api" / "abc")
    f, why = _probe_v1(V1_MOUNTS.format(mnt=tmp_path), "0::/\n")
    assert f is None


def test_counters(tmp_path):
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 1\n")
    (tmp_path / "memory.peak").write_text("1073741824\n")
    cg = CellCgroup("cgroup2", str(tmp_path), 1 << 30)
    assert cg.oom_kills() == 2 and cg.peak_bytes() == 1 << 30
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (tmp_path / "memory.max_usage_in_bytes").write_text("5\n")
    cg1 = CellCgroup("cgroup1", str(tmp_path), 1 << 30)
    assert cg1.oom_kills() == 1 and cg1.peak_bytes() == 5
    assert cg1.wrap(["deepspeed", "x"])[:3] == ["sh", "-c", 'echo $$ > "$0" && exec "$@"']
    assert cg1.wrap(["deepspeed", "x"])[3:] == [str(tmp_path / "cgroup.procs"), "deepspeed", "x"]
