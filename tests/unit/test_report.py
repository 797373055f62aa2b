"""The report from a synthetic results.jsonl: the right numbers in the right cells, OOM/ERR/TIMEOUT,
published columns beside ours, the aidaptiv / zero_infinity median, failures, figures."""

import os
import uuid

import pytest

from aidaptiv_ds.cli import main as aidaptiv_ds_main
from aidaptiv_ds.harness.report import build_report
from aidaptiv_ds.harness.report_tables import ratios
from aidaptiv_ds.harness.results import Row, append_row


def report_main(argv):
    """`aidaptiv-ds report ARGV`, in this process."""
    return aidaptiv_ds_main(["report", *argv])


MACHINE = {
    "host": "box1",
    "cpu": "Test CPU 9000",
    "cores": 8,
    "ram_gb": 64.0,
    "gpus": [{"name": "NVIDIA A100-SXM4-40GB", "memory_mb": 40960.0}] * 2,
    "kernel": "6.1.0",
    "swap_disk": {"device": "nvme0n1", "model": "Fast SSD", "rotational": False, "filesystem": "ext4"},
}
FACTOR = {"zero3": 1.0, "zero3_cpu_offload": 0.8, "zero_infinity": 0.5}
# aidaptiv / zero_infinity at each (seq, batch, gpus) where both run: median 1.7, mean 2.27
AID_RATIO = {
    (128, 8, 1): 1.0,
    (128, 8, 2): 1.2,
    (128, 32, 1): 1.4,
    (128, 32, 2): 2.0,
    (2048, 8, 1): 3.0,
    (2048, 8, 2): 5.0,
}


def tps(seq, mb, g, backend):
    base = seq * mb / 10 * g
    if backend == "aidaptiv":
        return base * 0.5 * AID_RATIO.get((seq, mb, g), 1.0)
    return base * FACTOR[backend]


def row(model="llama2-7b", backend="zero3", gpus=1, mb=8, seq=128, status="ok", t=None, **kw):
    r = {
        "row_id": uuid.uuid4().hex,
        "key": f"{model}__{backend}__g{gpus}__mb{mb}__s{seq}__ga1",
        "grid": "synthetic",
        "git_sha": "cafe123",
        "git_dirty": False,
        "time_start": "2026-03-01T10:00:00+00:00",
        "time_end": t or "2026-03-01T10:01:00+00:00",
        "wall_s": 60.0,
        "machine": MACHINE,
        "backend": backend,
        "model": model,
        "micro_batch": mb,
        "seq_len": seq,
        "gpus": gpus,
        "grad_accum": 1,
        "steps": 7,
        "warmup": 2,
        "status": status,
        "gpu_mem_cap_gb": 40.0,
        "host_mem_cap": {"gb": 192.0, "mechanism": "cgroup2", "detail": "/sys/fs/cgroup/x", "oom_kills": 0},
    }
    if status == "ok":
        r.update(
            tokens_per_s=tps(seq, mb, gpus, backend),
            step_s=1.0,
            nvme_read_gbps=1.5,
            nvme_write_gbps=0.5,
            phases_s={"forward": 0.2, "backward": 0.4, "optimizer": 0.3, "io_wait": 0.1},
            peak_rss_mb=1000.0,
        )
    r.update(kw)
    return Row.model_validate(r).model_dump()


def synthetic_rows():
    rows = []
    for seq in (128, 2048):
        for mb in (8, 32):
            for g in (1, 2):
                for b in ("zero3", "zero3_cpu_offload", "zero_infinity", "aidaptiv"):
                    status, extra = "ok", {}
                    if (seq, mb) == (2048, 32) and b == "zero3":
                        status = "oom"
                        extra = (
                            {"error": "torch.OutOfMemoryError: CUDA out of memory"}
                            if g == 1
                            else {"error": "skipped: smaller cell x ran out of memory", "inferred": True}
                        )
                    if (seq, mb, g) == (2048, 32, 1) and b == "zero_infinity":
                        status, extra = "oom", {"error": "killed by the host memory cap (cgroup2 limit 192 GiB)"}
                    if (seq, mb, g) == (2048, 32, 2) and b == "aidaptiv":
                        status, extra = "timeout", {"error": "no result after 3600 s: process tree killed"}
                    if (seq, mb, g) == (128, 8, 2) and b == "zero3_cpu_offload":
                        status, extra = "error", {"error": "RuntimeError: boom in layer 7"}
                    rows.append(row(backend=b, gpus=g, mb=mb, seq=seq, status=status, **extra))
    return rows


@pytest.fixture
def results_dir(tmp_path):
    rows = synthetic_rows()
    # an older, superseded row of one cell: the report must use the newer one
    stale = row(backend="zero3", gpus=1, mb=8, seq=128, t="2026-02-01T00:00:00+00:00", tokens_per_s=1.0)
    for r in [stale] + rows:
        append_row(str(tmp_path / "results.jsonl"), r)
    return tmp_path


def table_after(md, heading):
    """Rows of the first markdown table after ``heading``, as {(seq, batch): {column: text}}."""
    lines = md[md.index(heading) :].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| "))
    header = [h.strip() for h in lines[start].strip("|").split("|")]
    out = {}
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split(" | ")]
        out[(cells[0], cells[1])] = dict(zip(header, cells))
    return out


def test_throughput_table_has_our_numbers_and_the_papers(results_dir):
    md, _ = build_report(str(results_dir), plots=False)
    t = table_after(md, "### Throughput")
    assert t[("128", "8")]["ZeRO-3 1 GPU"] == "102"  # 128*8/10, the newer row, not the stale 1.0
    assert t[("2048", "32")]["ZeRO-3 CPU offload 2 GPU"] == "10,486"  # 2048*32/10*2*0.8
    assert t[("128", "8")]["aidaptiv 2 GPU"] == "123"  # 204.8 * 0.5 * 1.2
    assert t[("2048", "32")]["ZeRO-3 1 GPU"] == "OOM"
    assert t[("2048", "32")]["ZeRO-3 2 GPU"] == "OOM*"
    assert t[("2048", "32")]["ZeRO-Infinity 1 GPU"] == "OOM"
    assert t[("2048", "32")]["aidaptiv 2 GPU"] == "TIMEOUT"
    assert t[("128", "8")]["ZeRO-3 CPU offload 2 GPU"] == "ERR"
    pub1 = "C-DAC T.VI aiDAPTIV+ (A100 40GB PCIe), 1 GPU (published)"
    pub2 = "C-DAC T.VI aiDAPTIV+ (A100 40GB PCIe), 2 GPU (published)"
    assert (t[("128", "8")][pub1], t[("128", "8")][pub2]) == ("39", "84")
    assert (t[("2048", "32")][pub1], t[("2048", "32")][pub2]) == ("1,093", "1,703")
    assert (t[("128", "32")][pub1], t[("2048", "8")][pub2]) == ("100", "1,093")


def test_ratio_median_and_only_cells(results_dir):
    md, _ = build_report(str(results_dir), plots=False)
    assert "**1.70×**" in md and "over 6 cell(s)" in md
    r = table_after(md, "### aidaptiv / ZeRO-Infinity")
    assert r[("128", "32")]["2 GPU"] == "2.00×"
    assert r[("2048", "32")]["1 GPU"] == "aidaptiv only"
    assert r[("2048", "32")]["2 GPU"] == "ZeRO-Infinity only"
    rt = ratios(synthetic_rows())
    assert rt["median"] == pytest.approx(1.7)
    assert len(rt["only_num"]) == 1 and len(rt["only_den"]) == 1


def test_header_failures_and_feasibility(results_dir):
    md, _ = build_report(str(results_dir), plots=False)
    assert (
        "box1: Test CPU 9000 (flags not recorded), 8 cores, 64.0 GiB RAM, 2x NVIDIA A100-SXM4-40GB 40 GiB, kernel" in md
    )
    assert "- git: cafe123 (32 cells)" in md
    assert "- Dates (UTC): 2026-03-01T10:00:00+00:00 to 2026-03-01T10:01:00+00:00" in md
    assert "1 older row(s) superseded" in md
    assert "GPU memory cap 40 GB; host memory cap 192 GiB via cgroup2" in md
    fails = md[md.index("### Failures") :]
    assert "RuntimeError: boom in layer 7" in fails and "no result after 3600 s" in fails
    assert "inferred OOM from a smaller cell's OOM: 1 cell(s)" in fails
    block = md[md.index("**ZeRO-3**") : md.index("**ZeRO-3 CPU offload**")]
    assert "| 2048 | ✓ ✓ | ✗ ✗* |" in block


def test_status_counts(results_dir):
    md, _ = build_report(str(results_dir), plots=False)
    lines = [ln for ln in md.splitlines() if ln.startswith("| ZeRO-3 |")]
    assert lines[0] == "| ZeRO-3 | 6 | 1 | 1 | 0 | 0 | 8 |"


def test_cli_writes_report_and_figures(results_dir):
    assert report_main([str(results_dir)]) == 0
    md = (results_dir / "report.md").read_text()
    figs = sorted(os.listdir(results_dir / "figures"))
    assert figs == ["llama2-7b_feasibility.png", "llama2-7b_tput_vs_batch.png", "llama2-7b_tput_vs_gpus.png"]
    for f in figs:
        assert (results_dir / "figures" / f).stat().st_size > 5000
        assert f"(figures/{f})" in md


def test_empty_results_is_an_error(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "no usable rows" in capsys.readouterr().err


def test_signal65_and_figure8_sections(tmp_path):
    rows = [
        row(
            model="llama3.1-8b",
            backend="aidaptiv",
            gpus=1,
            mb=18,
            seq=12000,
            grad_accum=10,
            key="llama3.1-8b__aidaptiv__g1__mb18__s12000__ga10",
            tokens_per_s=1200.0,
        ),
        row(
            model="llama3.1-8b",
            backend="zero3",
            gpus=1,
            mb=18,
            seq=12000,
            grad_accum=10,
            status="oom",
            key="llama3.1-8b__zero3__g1__mb18__s12000__ga10",
            error="CUDA out of memory",
        ),
        row(
            model="llama3.1-70b",
            backend="aidaptiv",
            gpus=1,
            mb=80,
            seq=256,
            key="llama3.1-70b__aidaptiv__g1__mb80__s256__ga1",
            tokens_per_s=40.0,
        ),
        row(
            model="llama3.1-70b",
            backend="aidaptiv",
            gpus=1,
            mb=64,
            seq=256,
            key="llama3.1-70b__aidaptiv__g1__mb64__s256__ga1",
            tokens_per_s=45.0,
        ),
    ]
    for r in rows:
        append_row(str(tmp_path / "results.jsonl"), r)
    md, _ = build_report(str(tmp_path), plots=False)
    s65 = md[md.index("### Signal65") :]
    assert "| llama3.1-8b | 18 | 1 | done 1:08:20 | OOM | OOM | 1,200 tok/s; 1.9 h |" in s65
    f8 = md[md.index("### Peak over batch") :]
    assert "| 1 | 45.0 (batch 64) | 52.3 (batch 80) |" in f8
    t = table_after(md, "## llama3.1-8b")
    assert t[("12000", "18")]["Signal65 aiDAPTIV+ (RTX 6000 Ada 48GB), 1 GPU (published)"] == "done 1:08:20"
    assert t[("12000", "18")]["Signal65 Axolotl (RTX 6000 Ada 48GB), 1 GPU (published)"] == "OOM"


def test_cpu_rows_count_processes(tmp_path):
    cpu = dict(MACHINE, gpus=[])
    for b in ("zero3", "aidaptiv"):
        append_row(
            str(tmp_path / "results.jsonl"),
            row(
                model="micro",
                backend=b,
                gpus=2,
                mb=2,
                seq=64,
                machine=cpu,
                key=f"micro__{b}__g2__mb2__s64__ga1",
                tokens_per_s=500.0,
            ),
        )
    md, _ = build_report(str(tmp_path), plots=False)
    t = table_after(md, "### Throughput")
    assert t[("64", "2")]["ZeRO-3 2 proc"] == "500" and t[("64", "2")]["aidaptiv 2 proc"] == "500"
    assert "GPU)" not in md.split("## micro")[1].split("## Sources")[0].replace("peak GPU MB", "")


def test_table_vi_in_model_flops(tmp_path):
    """GPU cells of a scaled model against C-DAC Table VI at the same sequence: best over batch, as model
    FLOP/s (6 x parameters x tokens/s) and share of each GPU's bf16 peak."""
    h200 = dict(MACHINE, gpus=[{"name": "NVIDIA H200", "memory_mb": 143771.0}])
    rows = [
        row(
            model="tinyllama-1.1b",
            backend="aidaptiv",
            mb=mb,
            seq=2048,
            machine=h200,
            peak_gpu_mb=5000.0,
            key=f"tinyllama-1.1b__aidaptiv__g1__mb{mb}__s2048__ga1",
            tokens_per_s=tps_,
            params=1_100_048_384,
        )
        for mb, tps_ in ((4, 9000.0), (8, 15000.0))
    ]
    rows.append(
        row(
            model="tinyllama-1.1b",
            backend="aidaptiv",
            gpus=2,
            mb=8,
            seq=2048,
            machine=h200,
            peak_gpu_mb=5e3,
            key="tinyllama-1.1b__aidaptiv__g2__mb8__s2048__ga1",
            tokens_per_s=30000.0,
            params=1_100_048_384,
        )
    )
    rows.append(
        row(
            model="tinyllama-1.1b",
            backend="zero_infinity",
            mb=8,
            seq=2048,
            machine=h200,
            status="oom",
            key="tinyllama-1.1b__zero_infinity__g1__mb8__s2048__ga1",
            error="CUDA out of memory",
        )
    )
    for r in rows:
        append_row(str(tmp_path / "results.jsonl"), r)
    md, _ = build_report(str(tmp_path), plots=False)
    sec = md[md.index("### Against C-DAC Table VI") :]
    # 6 x 1.1e9 x 15000 = 99.0 TFLOP/s, 10.0% of 989; Llama 2-7B 1,093 tokens/s at batch 32: 6 x 6.738e9 x
    # 1093 = 44.2 TFLOP/s, 14.2% of 312; Llama 3.1-8B 488 at batch 8: 23.5 TFLOP/s, 7.5%.
    assert (
        "| 2048 | 1 | 15,000 (batch 8): 99.0 TFLOP/s, 10.0% of peak | 1,093 (batch 32): 44.2 TFLOP/s, 14.2% of "
        "peak | 488 (batch 8): 23.5 TFLOP/s, 7.5% of peak |"
    ) in sec
    # Two GPUs: the share is of both GPUs' peak (198 of 1978; theirs 1,732 at batch 24: 70.0 of 624).
    assert (
        "| 2048 | 2 | 30,000 (batch 8): 198.0 TFLOP/s, 10.0% of peak | 1,732 (batch 24): 70.0 TFLOP/s, 11.2% of" in sec
    )
    assert "zero_infinity" not in sec.split("\n\n")[2] and "ZeRO-Infinity" not in sec.split("\n\n")[2]
    assert "Ours on NVIDIA H200 (dense bf16 peak 989 TFLOP/s)" in sec


def test_no_table_vi_flops_section_for_cpu_rows(results_dir):
    md, _ = build_report(str(results_dir), plots=False)
    assert "### Against C-DAC Table VI" not in md
