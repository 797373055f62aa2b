"""Mixtures of experts trained through the aidaptiv block: full fine-tuning and LoRA of the micro-moe preset on one
rank, and full fine-tuning on two ranks, give stock ZeRO-3's losses, load-balancing loss included; two ranks
whose router sends their tokens to disjoint experts finish (no hang, within a bound) with the losses of stock
ZeRO-3 with the same leaf modules.

micro-moe: 4.6M parameters (2.2M active: 2 of 8 experts per token), a 40 MiB host budget, so parameters and
optimizer state move through the swap files every step.
"""

import os
import subprocess
import sys
import time

import pytest
from helpers import (
    CONFIGS,
    _free_port,
    adapter_config,
    aidaptiv_config,
    assert_same_losses,
    child_env,
    failure_excerpt,
    read_metrics,
    run_train,
)

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = ["--model", "micro-moe", "--seq-len", "64", "--steps", "3", "--warmup", "1", "--no-progress"]
LORA = ["--lora", "r=8,alpha=16,targets=q_proj,v_proj"]


def train(folder, config, name, *extra, procs=None):
    out = folder / f"{name}.json"
    rc, log = run_train(
        ["--config", config, *COMMON, "--metrics-out", str(out), *extra], cwd=folder, launcher_procs=procs
    )
    assert rc == 0, failure_excerpt(log)
    return read_metrics(out)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_micro_moe_through_the_block_matches_stock_zero3(tmp_path, mode):
    ours, ref = tmp_path / "ours", tmp_path / "ref"
    ours.mkdir(), ref.mkdir()
    if mode == "lora":
        m = train(ours, adapter_config(ours, "aidaptiv.json", budget="40MiB"), "m", *LORA)
        r = train(ref, adapter_config(ref, "zero3.json"), "r", *LORA)
        # 2 layers x (q_proj: 256 -> 256, v_proj: 256 -> 128) x r 8: the routers and experts stay frozen
        assert m["lora"]["trainable_params"] == r["lora"]["trainable_params"] == 2 * 8 * (256 + 256 + 256 + 128)
    else:
        cfg = aidaptiv_config(ours, host_memory_budget="40MiB", layer_group_size=1)
        m = train(ours, cfg, "m")
        r = train(ref, os.path.join(CONFIGS, "zero3.json"), "r")
        assert m["nvme_read_bytes"] / m["nvme_bytes_steps"] > m["params"] * 4  # the model is read every step
    assert m["backend"] == "aidaptiv" and r["backend"] == "zero3"
    # Both backends make each layer's MoE block a leaf; the load-balancing loss (micro-moe's coefficient 0.001)
    # is part of the loss, and reported on its own.
    assert m["moe"] == r["moe"] and m["moe"]["leaf_blocks"] == 2 and m["moe"]["router_aux_loss_coef"] == 0.001
    assert len(m["aux_losses"]) == 3 and all(a > 1.0 for a in m["aux_losses"])  # 1.0: a perfectly balanced router
    assert_same_losses(m["aux_losses"], r["aux_losses"], rel=1e-5)
    assert_same_losses(m["losses"], r["losses"], rel=1e-5)


@pytest.mark.long("two ranks against stock ZeRO-3: the disjoint-experts test below")
def test_micro_moe_on_two_ranks_matches_stock_zero3_on_two_ranks(tmp_path):
    # The preset's own routing (random weights) under the deepspeed launcher: each rank its own batches.
    ours, ref = tmp_path / "ours", tmp_path / "ref"
    ours.mkdir(), ref.mkdir()
    m = train(ours, aidaptiv_config(ours, host_memory_budget="40MiB", layer_group_size=1), "m", procs=2)
    r = train(ref, os.path.join(CONFIGS, "zero3.json"), "r", procs=2)
    assert m["world_size"] == r["world_size"] == 2 and m["moe"]["leaf_blocks"] == 2
    assert_same_losses(m["aux_losses"], r["aux_losses"], rel=1e-5)
    assert_same_losses(m["losses"], r["losses"], rel=1e-5)


def run_two_ranks(folder, config, leaves, timeout):
    """moe_disjoint_run.py as ranks 0 and 1; returns (each rank's RESULT, None), or (None, why) when a rank
    failed or both had not ended within ``timeout`` seconds (then both are killed)."""
    import json

    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "moe_disjoint_run.py"), config, leaves],
            cwd=folder,
            env=child_env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    deadline, outs = time.monotonic() + timeout, []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return None, f"no end within {timeout} s: " + "\n".join(q.communicate()[0][-1500:] for q in procs)
    if any(p.returncode for p in procs):
        return None, "\n---\n".join(o[-3000:] for o in outs)
    return [json.loads([x for x in o.splitlines() if x.startswith("RESULT ")][-1][7:]) for o in outs], None


def test_two_ranks_routed_to_disjoint_experts_end_with_stock_zero3s_losses(tmp_path):
    # Per-expert modules (a ModuleList of experts): only the experts a rank's tokens chose run on that rank, so
    # without leaf modules the ranks' ZeRO-3 collectives differ. Stock ZeRO-3 is given the leaves by
    # mark_moe_blocks; aidaptiv_ds.initialize makes them itself.
    ref, why = run_two_ranks(tmp_path, os.path.join(CONFIGS, "zero3.json"), "mark", timeout=240)
    assert ref is not None, why
    cfg = aidaptiv_config(tmp_path, host_memory_budget="16MiB", layer_group_size=1)
    ours, why = run_two_ranks(tmp_path, cfg, "initialize", timeout=240)
    assert ours is not None, why
    assert [r["experts_hit"] for r in ours] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # disjoint, as the router was told
    for o, r in zip(ours, ref):
        assert o["swapper"] and not r["swapper"]
        assert o["leaf_blocks"] == r["leaf_blocks"] == ["layers.0.mlp", "layers.1.mlp"]
        assert_same_losses(o["losses"], r["losses"], rel=1e-5)
