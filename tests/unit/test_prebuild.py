"""DeepSpeed op builds: the sweep warns about build locks a killed compile left behind (torch waits on them
forever), and every process builds with the ninja installed beside its Python."""

import os
import sys
import time
import types

from aidaptiv_ds.harness.prebuild import put_build_tools_first, stale_locks


def test_old_lock_files_are_reported_and_fresh_ones_are_not(tmp_path):
    old = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    fresh = tmp_path / "py311_cpu" / "async_io" / "lock"
    for p in (old, fresh):
        p.parent.mkdir(parents=True)
        p.touch()
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    assert stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == [str(old)]
    assert stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path / "missing")}) == []


def test_the_environments_bin_goes_first_on_path_once():
    bindir = os.path.dirname(sys.executable)
    env = {"PATH": os.pathsep.join(["/usr/bin", bindir, "/bin"])}
    put_build_tools_first(env)
    assert env["PATH"] == os.pathsep.join([bindir, "/usr/bin", "/bin"])
    put_build_tools_first(env)
    assert env["PATH"] == os.pathsep.join([bindir, "/usr/bin", "/bin"])
    empty = {}
    put_build_tools_first(empty)
    assert empty["PATH"] == bindir


def test_the_command_puts_it_first_before_any_subcommand_runs(monkeypatch):
    from aidaptiv_ds import cli

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    seen = []

    class Subcommand:
        @staticmethod
        def run(args):
            seen.append(os.environ["PATH"])
            return 0

    monkeypatch.setattr(cli, "parse_args", lambda argv: types.SimpleNamespace(_module=Subcommand))
    assert cli.main(["report"]) == 0
    assert seen[0].split(os.pathsep)[0] == os.path.dirname(sys.executable)
