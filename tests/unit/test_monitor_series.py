"""Per-step series for DeepSpeed's monitor (aidaptiv_ds.common.metrics.monitor_events) and `aidaptiv-ds report
RUN_DIR` on one run's folder (aidaptiv_ds.harness.run_report): no DeepSpeed run needed."""

import csv
import json

from aidaptiv_ds.cli import main
from aidaptiv_ds.common import metrics as M

RECORD = {"step_s": 2.0, "forward": 0.5, "backward": 1.0, "optimizer": 0.5}


def test_monitor_events_of_a_step():
    ev = M.monitor_events(
        7,
        RECORD,
        loss=3.5,
        lr=1e-4,
        tokens_per_step=1000,
        io_bytes=(4e9, 2e9),
        host_budget=2**30,
        pinned=2**20,
        gpu_mb=None,
        rss_mb=512.0,
    )
    got = {name: (value, step) for name, value, step in ev}
    assert {s for s in got} == {"aidaptiv/" + s for s in M.MONITOR_SERIES if s != "gpu_mem_mb"}
    assert all(step == 7 for _, step in got.values())
    assert got["aidaptiv/loss"][0] == 3.5 and got["aidaptiv/tokens_per_s"][0] == 500.0
    assert got["aidaptiv/nvme_read_GBps"][0] == 2.0 and got["aidaptiv/nvme_write_GBps"][0] == 1.0
    assert got["aidaptiv/backward_s"][0] == 1.0 and got["aidaptiv/host_budget_bytes"][0] == 2**30
    assert got["aidaptiv/host_rss_mb"][0] == 512.0


def test_what_was_not_measured_is_left_out_not_zero():
    ev = M.monitor_events(
        1, RECORD, loss=1.0, lr=None, tokens_per_step=10, io_bytes=None, host_budget=None, pinned=None, gpu_mb=None
    )
    names = {n for n, _, _ in ev}
    assert names == {
        "aidaptiv/" + s for s in ("loss", "tokens_per_s", "step_s", "forward_s", "backward_s", "optimizer_s")
    }


def _write_csv_monitor(folder, steps=4):
    """Files as DeepSpeed's csvMonitor writes them: <name with / as _>.csv, header 'step,<last part>'."""
    folder.mkdir(parents=True)
    for s in M.MONITOR_SERIES:
        with open(folder / f"aidaptiv_{s}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", s])
            for i in range(1, steps + 1):
                w.writerow([i, 10.0 / i])


def test_report_of_a_run_folder_plots_its_csv_series(tmp_path, capsys):
    _write_csv_monitor(tmp_path / "run" / "monitor" / "job")
    assert main(["report", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "figures" / "run_curves.png"
    assert png.stat().st_size > 10000
    err = capsys.readouterr().err
    assert "CSV monitor" in err and "loss" in err and "nvme_read_GBps" in err


def test_report_of_a_run_folder_with_only_metrics_json(tmp_path, capsys):
    (tmp_path / "m.json").write_text(
        json.dumps(
            {
                "status": "ok",
                "losses": [5.0, 4.0, 3.0],
                "step_s": [1.0, 2.0, 4.0],
                "tokens_per_step": 100,
                "first_step": 0,
            }
        )
    )
    from aidaptiv_ds.harness import run_report

    series, source = run_report.find_series(str(tmp_path))
    assert source == "metrics JSON"
    assert series["tokens_per_s"] == [(1.0, 100.0), (2.0, 50.0), (3.0, 25.0)]
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "figures" / "run_curves.png").stat().st_size > 10000


def test_report_draws_the_held_out_loss_from_the_metrics_json(tmp_path):
    (tmp_path / "m.json").write_text(
        json.dumps(
            {
                "status": "ok",
                "losses": [5.0, 4.0, 3.0, 2.5],
                "step_s": [1.0, 1.0, 1.0, 1.0],
                "tokens_per_step": 100,
                "first_step": 0,
                "eval_losses": [[2, 4.5], [4, 3.25]],
            }
        )
    )
    from aidaptiv_ds.harness import run_report

    series, _ = run_report.find_series(str(tmp_path))
    assert series["eval_loss"] == [(2.0, 4.5), (4.0, 3.25)]
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "figures" / "run_curves.png").stat().st_size > 10000


def test_report_draws_the_held_out_loss_from_the_csv_monitor(tmp_path):
    folder = tmp_path / "run" / "monitor" / "job"
    _write_csv_monitor(folder)
    with open(folder / "aidaptiv_eval_loss.csv", "w", newline="") as f:
        csv.writer(f).writerows([["step", "eval_loss"], [2, 7.0], [4, 6.0]])
    from aidaptiv_ds.harness import run_report

    series, source = run_report.find_series(str(tmp_path / "run"))
    assert "CSV monitor" in source and series["eval_loss"] == [(2.0, 7.0), (4.0, 6.0)]


def test_report_takes_the_held_out_loss_from_the_json_when_the_csv_lacks_it(tmp_path):
    _write_csv_monitor(tmp_path / "monitor" / "job")
    (tmp_path / "m.json").write_text(
        json.dumps({"status": "ok", "losses": [5.0, 4.0], "step_s": [1.0, 1.0], "eval_losses": [[2, 3.0]]})
    )
    from aidaptiv_ds.harness import run_report

    series, _ = run_report.find_series(str(tmp_path))
    assert series["eval_loss"] == [(2.0, 3.0)] and len(series["loss"]) == 4


def test_the_loss_panel_shows_the_held_out_loss(tmp_path, monkeypatch):
    import matplotlib.axes

    from aidaptiv_ds.harness import run_report

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda self, *a, **kw: drawn.append((self.get_title(), kw.get("label"))) or real(self, *a, **kw),
    )
    run_report.plot(str(tmp_path), {"loss": [(1.0, 3.0), (2.0, 2.0)], "eval_loss": [(2.0, 2.5)]}, "metrics JSON")
    assert ("loss", "eval_loss") in drawn and ("loss", "loss") in drawn


def test_runs_sharing_a_monitor_folder_are_not_plotted_as_one(tmp_path, capsys):
    """Two runs appended to one job's CSV files (the step count starts again), and a second job folder: the
    report plots one run, the newest, and says what it left out, instead of one zig-zag curve."""
    from aidaptiv_ds.harness import run_report

    folder = tmp_path / "run" / "monitor" / "job"
    _write_csv_monitor(folder, steps=4)
    with open(folder / "aidaptiv_loss.csv", "a", newline="") as f:  # a second run, appended
        csv.writer(f).writerows([[1, 5.0], [2, 4.0], [3, 3.0]])
    warnings = []
    series = run_report.csv_series(str(tmp_path / "run"), warnings)
    assert series["loss"] == [(1.0, 5.0), (2.0, 4.0), (3.0, 3.0)]
    assert any("holds 2 runs" in w and "aidaptiv_loss.csv" in w for w in warnings), warnings
    _write_csv_monitor(tmp_path / "run" / "monitor" / "job2", steps=2)
    assert main(["report", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "warning: 2 files hold the series" in err and "own csv_monitor output_path or job_name" in err
