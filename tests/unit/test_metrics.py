import json
import math

import pytest

from aidaptiv_ds.common import metrics as M


def records(times):
    return [{"step_s": t, "forward": t / 4, "backward": t / 2, "optimizer": t / 4} for t in times]


def test_summarize_medians_after_warmup():
    m = M.summarize(
        step_records=records([10.0, 1.0, 3.0, 2.0]),
        warmup=1,
        tokens_per_step=100,
        losses=[5.0, 4.0, 3.0, 2.0],
        engine_stats=None,
        peak_rss=123.0,
        peak_gpu=None,
        nvme_read=10,
        nvme_write=20,
        extra={"model": "micro"},
    )
    assert m["status"] == "ok" and m["model"] == "micro"
    assert m["step_s_median"] == 2.0 and m["tokens_per_s"] == 50.0
    assert m["step_s"] == [10.0, 1.0, 3.0, 2.0]
    assert m["phases_s"] == {"forward": 0.5, "backward": 1.0, "optimizer": 0.5, "io_wait": None}
    assert m["peak_pinned_mb"] is None and m["peak_gpu_mb"] is None
    assert (m["nvme_read_bytes"], m["nvme_write_bytes"]) == (10, 20)


def test_summarize_uses_all_steps_when_none_are_past_warmup():
    m = M.summarize(
        step_records=records([4.0]),
        warmup=2,
        tokens_per_step=8,
        losses=[1.0],
        engine_stats=None,
        peak_rss=1.0,
        peak_gpu=None,
        nvme_read=None,
        nvme_write=None,
        extra={},
    )
    assert m["step_s_median"] == 4.0 and m["tokens_per_s"] == 2.0


def test_engine_stats_hook():
    stats = {"io_wait_s": [9.0, 0.5, 0.25, 0.75], "peak_pinned_bytes": 3 * 2**20}
    m = M.summarize(
        step_records=records([1.0] * 4),
        warmup=1,
        tokens_per_step=1,
        losses=[1.0] * 4,
        engine_stats=stats,
        peak_rss=1.0,
        peak_gpu=None,
        nvme_read=0,
        nvme_write=0,
        extra={},
    )
    assert m["phases_s"]["io_wait"] == 0.5 and m["peak_pinned_mb"] == 3.0


def test_write_json_is_strict_and_exclusive(tmp_path):
    path = tmp_path / "sub" / "m.json"
    assert M.write_json(str(path), {"losses": [1.0, float("nan"), float("inf")], "x": {"y": [math.inf]}})
    text = path.read_text()
    assert json.loads(text) == {"losses": [1.0, None, None], "x": {"y": [None]}}
    assert not M.write_json(str(path), {"a": 1}, exclusive=True)
    assert json.loads(path.read_text())["losses"][0] == 1.0
    assert list(tmp_path.joinpath("sub").iterdir()) == [path], "no temp file left behind"


def test_proc_io_and_rss_are_measured(tmp_path):
    io = M.proc_io()
    assert io is not None and io["read_bytes"] >= 0 and io["write_bytes"] >= 0
    assert M.peak_rss_mb() > 10


def test_step_timer_accumulates_phases():
    t = M.StepTimer()
    t.start_step()
    t.add("forward", 1.0)
    t.add("forward", 0.5)
    t.add("optimizer", 0.25)
    assert t.end_step() >= 0
    assert t.steps[0]["forward"] == 1.5 and t.steps[0]["backward"] == 0.0 and t.steps[0]["optimizer"] == 0.25


def test_one_line():
    assert "status=oom" in M.one_line({"status": "oom", "error": "OutOfMemoryError: x"})
    line = M.one_line(
        {
            "status": "ok",
            "model": "micro",
            "tokens_per_s": 12.5,
            "losses": [2.0, 1.0],
            "nvme_read_bytes": 2**20,
            "nvme_write_bytes": None,
            "phases_s": {},
        }
    )
    assert "\n" not in line and "tokens/s=12.5" in line and "loss=2.0000->1.0000" in line and "1.0/null" in line


def test_disk_busy_is_the_share_of_the_window_with_requests_in_flight(tmp_path):
    start = [("/dev/vda", 100.0, 5_000), ("/dev/vda", 100.0, 5_000), ("/dev/nvme0n1", 100.0, 0), None]
    end = [("/dev/vda", 110.0, 12_000), ("/dev/vda", 110.0, 12_000), ("/dev/nvme0n1", 110.0, 20_000), None]
    # one entry per device (two swap folders on one disk count once); never above 1 (io_ticks rounds up)
    assert M.disk_busy(start, end) == [
        {"device": "/dev/vda", "fraction": 0.7},
        {"device": "/dev/nvme0n1", "fraction": 1.0},
    ]
    assert M.disk_busy([None], [None]) is None
    # an evaluation of 4 s inside the window, the disk busy 3.5 s of it: the steps had 6 s, busy 3.5 s
    evals = [([("/dev/vda", 102.0, 6_000)], [("/dev/vda", 106.0, 9_500)])]
    assert M.disk_busy(start[:1], end[:1], evals) == [{"device": "/dev/vda", "fraction": round(3.5 / 6, 4)}]
    assert M.disk_busy_ticks(None) is None and M.disk_busy_ticks("/dev/no-such-disk") is None
    from aidaptiv_ds.engine.disk import block_device

    device = block_device(str(tmp_path))["device"]
    if device is None:
        pytest.skip("this filesystem has no block device in sysfs")
    a = M.disk_busy_ticks(device)
    assert a is not None and a[0] == device and a[2] >= 0
    line = M.one_line({"status": "ok", "phases_s": {}, "disk_busy": [{"device": "/dev/vda", "fraction": 0.7}]})
    assert line.endswith(" disk_busy=vda:70%")


def test_swapper_update_share_and_counters_are_reported():
    records = [{"step_s": 1.0, "forward": 0.6, "backward": 0.3, "optimizer": 0.1}] * 4
    stats = {
        "io_wait_s": [0.9, 0.5, 0.4, 0.3],
        "optimizer_apply_s_steps": [0.0, 0.4, 0.5, 0.6],
        "peak_pinned_bytes": 2**20,
        "nvme_read_bytes": 10,
    }
    m = M.summarize(
        step_records=records,
        warmup=1,
        tokens_per_step=10,
        losses=[1.0] * 4,
        engine_stats=stats,
        peak_rss=1.0,
        peak_gpu=None,
        nvme_read=None,
        nvme_write=None,
        extra={},
    )
    assert m["phases_s"]["optimizer_update"] == 0.5 and m["phases_s"]["io_wait"] == 0.4
    assert m["swapper"] == {"peak_pinned_bytes": 2**20, "nvme_read_bytes": 10}
