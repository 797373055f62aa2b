"""Automatic I/O tuning: the NVMe probe's block size x queue depth sweep, its choice, and the swapper taking
the cached choice where the block says "auto" (and saying where each value came from)."""

import json
import os
import sys

import pytest

from aidaptiv_ds.common.sizes import KiB, MiB
from aidaptiv_ds.config import ds_config, resolve, settings
from aidaptiv_ds.engine import tuning as T
from aidaptiv_ds.engine.machine_cache import disk_key, save_cache


def row(block, depth, write, read):
    return {"block_size": block, "queue_depth": depth, "write": write, "read": read}


# A disk that wants deep queues of mid-sized blocks: 1 MiB x 128 is the fastest; 4 MiB x 32 is within 5% of it.
TABLE = [
    row(256 * KiB, 8, 0.5e9, 0.6e9),
    row(256 * KiB, 128, 1.5e9, 2.0e9),
    row(1 * MiB, 32, 1.8e9, 2.2e9),
    row(1 * MiB, 128, 2.0e9, 3.0e9),
    row(4 * MiB, 32, 2.0e9, 2.9e9),
    row(4 * MiB, 128, 1.9e9, 2.5e9),
]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("AIDAPTIV_DS_CACHE_DIR", raising=False)  # the suite-wide cache (conftest) would win


def swept(directory, table=TABLE):
    """A cache that holds ``table`` as the sweep of the disk under ``directory`` (a fake probe result)."""
    save_cache(
        {
            disk_key(str(directory)): {
                "nvme_read": 3e9,
                "nvme_write": 2e9,
                "block_size": 1 * MiB,
                "queue_depth": 128,
                "io_sweep": table,
                "when": "measured test",
            }
        }
    )


def block(path, **extra):
    return {"enabled": True, "nvme_path": str(path), "host_memory_budget": "1GiB", **extra}


def test_choice_is_the_fastest_or_the_fewest_bytes_in_flight_among_ties():
    # 1 MiB x 128 (1.2 GB/s write-then-read) and 4 MiB x 32 (1.18 GB/s) tie within 5%: 4 MiB x 32 holds the same
    # 128 MiB in flight, and is slower, so 1 MiB x 128 wins; a table where a smaller pair ties picks it.
    assert T.choose(TABLE) == (1 * MiB, 128)
    tie = TABLE + [row(512 * KiB, 64, 2.0e9, 2.9e9)]  # as fast as 4 MiB x 32, 32 MiB in flight
    assert T.choose(tie) == (512 * KiB, 64)
    assert T.choose(TABLE, block_size=4 * MiB) == (4 * MiB, 32)  # the best queue depth for a given block size
    assert T.choose(TABLE, queue_depth=8) == (256 * KiB, 8)
    assert T.choose(TABLE, block_size=2 * MiB) is None
    assert T.choose([{"block_size": 3, "queue_depth": 8, "write": 1, "read": 1}]) is None  # not a valid row
    assert T.choose([]) is None


def test_auto_takes_the_tuned_choice_of_the_disk_and_says_so(tmp_path):
    swept(tmp_path)
    s = settings.SwapSettings.from_block(block(tmp_path))
    assert (s.block_size, s.queue_depth) == (1 * MiB, 128)
    assert (s.block_size_source, s.queue_depth_source) == ("tuned", "tuned")
    # One given, the other the best the sweep measured with it.
    s = settings.SwapSettings.from_block(block(tmp_path, block_size=4 * MiB))
    assert (s.block_size, s.queue_depth, s.block_size_source, s.queue_depth_source) == (4 * MiB, 32, "config", "tuned")
    # A given value the sweep never tried: the other one is the sweep's overall choice.
    s = settings.SwapSettings.from_block(block(tmp_path, queue_depth=3))
    assert (s.block_size, s.queue_depth, s.block_size_source, s.queue_depth_source) == (1 * MiB, 3, "tuned", "config")
    s = settings.SwapSettings.from_block(block(tmp_path, block_size=64 * KiB, queue_depth=16))
    assert (s.block_size, s.queue_depth, s.block_size_source, s.queue_depth_source) == (
        64 * KiB,
        16,
        "config",
        "config",
    )
    s = settings.SwapSettings.from_block(block(tmp_path, block_size="auto", queue_depth="auto"))
    assert (s.block_size, s.queue_depth, s.block_size_source) == (1 * MiB, 128, "tuned")


def test_auto_on_a_disk_never_swept_is_the_engine_default(tmp_path):
    from aidaptiv_ds.engine import io

    assert (T.DEFAULT_BLOCK_SIZE, T.DEFAULT_QUEUE_DEPTH) == (io.DEFAULT_BLOCK_SIZE, io.DEFAULT_QUEUE_DEPTH)
    s = settings.SwapSettings.from_block(block(tmp_path))
    assert (s.block_size, s.queue_depth, s.block_size_source, s.queue_depth_source) == (
        1 * MiB,
        32,
        "default",
        "default",
    )
    swept(tmp_path, table=[{"garbage": 1}])  # a cache entry without a usable sweep counts as none
    assert settings.SwapSettings.from_block(block(tmp_path)).block_size_source == "default"


def test_written_out_block_gives_the_same_settings_without_the_cache(tmp_path):
    swept(tmp_path)
    s = settings.SwapSettings.from_block(block(tmp_path))
    out = s.block()
    assert out["block_size"] == 1 * MiB and out["queue_depth"] == 128 and "block_size_source" not in out
    os.remove(os.path.join(os.environ["XDG_CACHE_HOME"], "aidaptiv-ds", "rates.json"))
    again = settings.SwapSettings.from_block(out)
    assert again == s and again.block_size_source == "config"


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("block_size", "fast", "expected 'auto', a size such as '1MiB', or an integer from 4096 to 67108864"),
        ("block_size", 1000 * KiB + 1, "multiple of 4096"),
        ("block_size", 128 * MiB, "from 4096 to 67108864, got 134217728"),
        ("queue_depth", 0, "expected 'auto' or an integer from 1 to 4096, got 0"),
        ("queue_depth", True, "got True"),
    ],
)
def test_bad_io_settings_are_refused_with_what_is_accepted(tmp_path, key, value, words):
    with pytest.raises(ds_config.ConfigError) as err:
        resolve.validate({"zero_optimization": {"stage": 3}, "aidaptiv": block(tmp_path, **{key: value})})
    assert f"aidaptiv.{key}" in str(err.value) and words in str(err.value)


def test_plan_reports_the_tuned_choice(tmp_path, monkeypatch, capsys):
    from aidaptiv_ds import cli
    from aidaptiv_ds.planner import rates as R

    probed = []

    def fake_nvme(directory, **_):
        probed.append(directory)
        return {"nvme_read": 3e9, "nvme_write": 2e9, "block_size": 1 * MiB, "queue_depth": 128, "io_sweep": TABLE}

    monkeypatch.setattr(R, "probe_nvme", fake_nvme)
    monkeypatch.setattr(R, "probe_cpu", lambda dtype: {"cpu_flops": 1e11, "cpu_adam": 1e8})
    monkeypatch.setattr(R, "probe_framework", lambda: {"framework_host": 1e9})
    monkeypatch.setattr(R, "probe_launcher", lambda: {"launcher_host": 5e8})
    monkeypatch.setattr(R, "probe_zero3", lambda flops, adam: {"zero3_cpu": 1e8})
    assert (
        cli.main(
            [
                "plan",
                "--model",
                "tiny",
                "--seq-len",
                "64",
                "--micro-batch",
                "1",
                "--nvme-path",
                str(tmp_path),
                "--backend",
                "aidaptiv",
            ]
        )
        == 0
    )
    assert "I/O tuned for the swap disk: block_size 1024 KiB, queue_depth 128" in capsys.readouterr().out
    cli.main(
        [
            "plan",
            "--model",
            "tiny",
            "--seq-len",
            "64",
            "--micro-batch",
            "1",
            "--nvme-path",
            str(tmp_path),
            "--backend",
            "aidaptiv",
            "--json",
        ]
    )
    assert json.loads(capsys.readouterr().out)["io_tuning"]["queue_depth"] == 128
    assert probed == [str(tmp_path)]  # once: the second plan read the cache
    # ... and the swapper on that disk takes it.
    s = settings.SwapSettings.from_block(block(tmp_path))
    assert (s.block_size, s.queue_depth, s.block_size_source) == (1 * MiB, 128, "tuned")


def test_train_logs_which_settings_it_used(tmp_path, capsys):
    from aidaptiv_ds.job import train

    swept(tmp_path)
    run = train.Run.__new__(train.Run)
    run.rank, run.info, run.backend = 0, {}, "aidaptiv"
    run.say = lambda m: print(m, file=sys.stderr)
    run.cfg = {"zero_optimization": {"stage": 3}, "aidaptiv": block(tmp_path, queue_depth=64)}
    run.note_io_settings()
    assert "aidaptiv I/O: block_size 1024 KiB (tuned), queue_depth 64 (config)" in capsys.readouterr().err
    assert run.info["aidaptiv_io"] == {
        "block_size": 1 * MiB,
        "block_size_source": "tuned",
        "queue_depth": 64,
        "queue_depth_source": "config",
    }


def test_real_probe_sweeps_and_the_swapper_takes_its_choice(tmp_path, monkeypatch):
    """A real, short sweep (files of 4 MiB) on the disk under tmp_path, through the rates cache."""
    pytest.importorskip("aidaptiv_ds.engine._C")
    from aidaptiv_ds.engine.disk import MEMORY_FILESYSTEMS, mount_of
    from aidaptiv_ds.planner import rates as R

    with open("/proc/self/mounts") as f:
        if mount_of(str(tmp_path), f.read())["fstype"] in MEMORY_FILESYSTEMS:
            pytest.skip("tmp_path is on a memory filesystem (no O_DIRECT)")
    real = R.probe_nvme
    monkeypatch.setattr(R, "probe_nvme", lambda d: real(d, nbytes=4 * MiB, repeats=1))
    monkeypatch.setattr(R, "probe_cpu", lambda dtype: {"cpu_flops": 1e11, "cpu_adam": 1e8})
    monkeypatch.setattr(R, "probe_framework", lambda: {"framework_host": 1e9})
    monkeypatch.setattr(R, "probe_launcher", lambda: {"launcher_host": 5e8})
    monkeypatch.setattr(R, "probe_zero3", lambda flops, adam: {"zero3_cpu": 1e8})
    swap = tmp_path / "swap"
    swap.mkdir()
    rates = R.machine_rates("fp32", str(swap))
    table = R.load_cache()[disk_key(str(swap))]["io_sweep"]
    assert len(table) == len(T.CANDIDATE_BLOCKS) * len(T.CANDIDATE_DEPTHS)
    assert all(r["write"] > 0 and r["read"] > 0 for r in table)
    assert (rates.io["block_size"], rates.io["queue_depth"]) == T.choose(table)
    assert rates.nvme_read > 0 and rates.nvme_write > 0
    assert os.listdir(swap) == []  # every sweep and probe file is gone
    s = settings.SwapSettings.from_block(block(swap))
    assert (s.block_size, s.queue_depth) == T.choose(table) and s.queue_depth_source == "tuned"
