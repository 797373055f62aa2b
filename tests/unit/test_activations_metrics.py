"""The activation figures of a run's metrics: the policy's counters at top level, and the backward's wait for
stored activations per optimizer step (summed over its micro-steps, median after warm-up)."""

from aidaptiv_ds.common import metrics as M


def test_activation_counters_and_wait_per_step():
    records = [{"step_s": 1.0, "forward": 0.6, "backward": 0.3, "optimizer": 0.1}] * 3
    activations = {"policy": "nvme", "bytes_stored": 4096, "io_wait_s_cycles": [9.0, 9.0, 0.1, 0.2, 0.3, 0.5]}
    stats = {"io_wait_s": [0.0] * 3, "nvme_read_bytes": 10, "activations": activations}
    m = M.summarize(
        step_records=records,
        warmup=1,
        tokens_per_step=10,
        losses=[1.0] * 3,
        engine_stats=stats,
        peak_rss=1.0,
        peak_gpu=None,
        nvme_read=None,
        nvme_write=None,
        extra={"grad_accum": 2},
    )
    assert m["activations"] == activations
    # Steps wait 18.0, 0.3 and 0.8 s; the first is warm-up.
    assert abs(m["phases_s"]["activation_io_wait"] - 0.55) < 1e-9
    assert "activations" not in m["swapper"]


def test_no_activation_figures_without_a_policy():
    records = [{"step_s": 1.0, "forward": 0.6, "backward": 0.3, "optimizer": 0.1}]
    m = M.summarize(
        step_records=records,
        warmup=0,
        tokens_per_step=10,
        losses=[1.0],
        engine_stats=None,
        peak_rss=1.0,
        peak_gpu=None,
        nvme_read=None,
        nvme_write=None,
        extra={},
    )
    assert "activations" not in m and "activation_io_wait" not in m["phases_s"]
