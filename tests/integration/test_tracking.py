"""A real run with DeepSpeed's monitor sections on: every step's series (aidaptiv_ds.common.metrics.MONITOR_SERIES)
reaches the CSV monitor's files and, where the tensorboard and wandb packages are installed, TensorBoard's
event files and W&B's offline run file; `aidaptiv-ds report RUN_DIR` plots them."""

import csv
import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest
from helpers import CONFIGS, child_env, read_metrics, run_train

STEPS = 3
# Measured on every run with our swapper on CPU (no CUDA: no GPU memory series).
EXPECTED = [
    s
    for s in (
        "loss",
        "lr",
        "tokens_per_s",
        "step_s",
        "forward_s",
        "backward_s",
        "optimizer_s",
        "nvme_read_GBps",
        "nvme_write_GBps",
        "host_budget_bytes",
        "pinned_bytes",
        "host_rss_mb",
    )
]


def wandb_rows(path):
    """The history rows of a W&B offline run file (run-<id>.wandb), as {name: value} dicts in order.

    wandb 0.31 has no Python reader of its own for these files (its Go core writes and syncs them): they are
    a 7-byte header (":W&B", magic 0xBEE1, version 0) then a LevelDB log (32 KiB blocks, records of a 7-byte
    header: crc32c, length, type FULL/FIRST/MIDDLE/LAST) of wandb's own protobuf Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    block, pos, pieces, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        pieces = chunk if kind in (1, 2) else pieces + chunk
        if kind in (1, 4):
            records.append(pieces)
    rows = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_monitors_receive_every_series_every_step_and_report_plots_them(tmp_path, monkeypatch):
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    (tmp_path / "swap").mkdir()
    cfg["aidaptiv"].update(nvme_path=str(tmp_path / "swap"), host_memory_budget="64MiB")
    run_dir = tmp_path / "run"
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(run_dir / "csv"), "job_name": "micro"}
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    if tensorboard:
        cfg["tensorboard"] = {"enabled": True, "output_path": str(run_dir / "tb"), "job_name": "micro"}
    wandb = importlib.util.find_spec("wandb") is not None
    if wandb:  # offline by default, files in the --metrics-out folder; nothing may reach the network
        cfg["wandb"] = {"enabled": True, "project": "aidaptiv-test"}
        for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: a contact would fail
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    rc, log = run_train(
        [
            "--config",
            str(tmp_path / "c.json"),
            "--model",
            "micro",
            "--seq-len",
            "64",
            "--steps",
            str(STEPS),
            "--warmup",
            "0",
            "--no-progress",
            "--metrics-out",
            str(run_dir / "m.json"),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    m = read_metrics(run_dir / "m.json")
    folder = run_dir / "csv" / "micro"
    for s in EXPECTED:
        with open(folder / f"aidaptiv_{s}.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["step", s] and [int(r[0]) for r in rows[1:]] == list(range(1, STEPS + 1)), (s, rows)
        values = [float(r[1]) for r in rows[1:]]
        if s == "loss":
            assert values == pytest.approx(m["losses"], rel=1e-12)
        elif s == "step_s":
            assert values == pytest.approx(m["step_s"], rel=1e-12)
        elif s == "host_budget_bytes":
            assert values == [64 * 2**20] * STEPS
        elif s not in ("nvme_read_GBps", "nvme_write_GBps"):
            assert all(v > 0 for v in values), (s, values)
    # Where the run's own counter saw swap writes (a block device, not tmpfs), the per-step series shows them.
    with open(folder / "aidaptiv_nvme_write_GBps.csv", newline="") as f:
        writes = [float(r[1]) for r in list(csv.reader(f))[1:]]
    assert all(v >= 0 for v in writes) and (any(v > 0 for v in writes) or not m["nvme_write_bytes"]), writes

    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import (
            EventAccumulator,
        )

        logs = [os.path.join(d, f) for d, _, fs in os.walk(run_dir / "tb") for f in fs if "tfevents" in f]
        assert logs, os.listdir(run_dir / "tb")
        acc = EventAccumulator(os.path.dirname(logs[0]))
        acc.Reload()
        for s in EXPECTED:
            events = acc.Scalars(f"aidaptiv/{s}")
            assert [e.step for e in events] == list(range(1, STEPS + 1)), s
        assert [e.value for e in acc.Scalars("aidaptiv/loss")] == pytest.approx(m["losses"], rel=1e-6)

    if wandb:
        files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(files) == 1 and m["wandb"] == {"mode": "offline", "dir": str(run_dir)}, (files, m.get("wandb"))
        rows = [r for r in wandb_rows(files[0]) if "aidaptiv/step" in r]
        # One row per optimizer step on DeepSpeed's own W&B step (samples so far: 2 per step here).
        assert [r["aidaptiv/step"] for r in rows] == list(range(1, STEPS + 1)), rows
        assert [r["_step"] for r in rows] == [2 * s for s in range(1, STEPS + 1)]
        for s in EXPECTED:
            assert all(f"aidaptiv/{s}" in r for r in rows), s
        assert [r["aidaptiv/loss"] for r in rows] == pytest.approx(m["losses"], rel=1e-12)

    p = subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", "report", str(run_dir)], env=child_env(), capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert (run_dir / "figures" / "run_curves.png").stat().st_size > 10000 and "CSV monitor" in p.stderr


def test_tensorboard_is_importable_for_the_monitor():
    pytest.importorskip(
        "tensorboard",
        reason="tensorboard==2.21.0 is not installed: the TensorBoard half of the tracking test is skipped",
    )
