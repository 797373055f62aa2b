"""A plain user script reaches the swapper: examples/zero_init_train.py (the model built under
``deepspeed.zero.Init(config_dict_or_path=config)``, ``deepspeed.initialize``, a loop of forward, backward and
step; nothing in it knows about aidaptiv) with the shipped ds_configs/aidaptiv.json, its host budget (40 MiB)
below the model state (94 MiB of the micro shape), started with plain ``python`` from its own directory.

The start-up hook must route both entry points through our swapper: the layer groups are the model's blocks
(not the by-size fallback), they are prefetched, and the state moves through the swap file every step.
bench/user_paths.py times this path beside the HF Trainer and our train job.
"""

import json
import os
import re
import subprocess
import sys

from helpers import CONFIGS, REPO, child_env, failure_excerpt

SCRIPT = os.path.join(REPO, "examples", "zero_init_train.py")
# The micro preset's shape (aidaptiv_ds.models.presets): 2 blocks.
MICRO = ["--hidden", "256", "--layers", "2", "--heads", "4", "--intermediate", "2048", "--vocab", "2048"]
STEPS = 3


def test_plain_zero_init_script_streams_through_layer_groups(tmp_path):
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg["aidaptiv"].update(nvme_path=str(swap), host_memory_budget="40MiB", layer_group_size=1)
    config, out = tmp_path / "ds.json", tmp_path / "run.json"
    config.write_text(json.dumps(cfg))
    p = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--config",
            str(config),
            "--steps",
            str(STEPS),
            "--warmup",
            "1",
            "--json-out",
            str(out),
            *MICRO,
        ],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, failure_excerpt(p.stdout)
    run = json.loads(out.read_text())
    stats = run["aidaptiv_stats"]
    assert stats is not None, "the start-up hook did not route deepspeed.initialize through aidaptiv"
    # Start-up reads the parameters once (for the fp32 master copies), not once more to register each
    # parameter's gradient hook (DeepSpeed 0.19.8 gathers every parameter for that; the hook needs no data).
    # (Each partition's read is rounded up to the 4 KiB alignment of O_DIRECT: 1% covers it; twice was the old.)
    assert run["initialize_read_bytes"] <= 1.01 * 4 * run["params"], (run["initialize_read_bytes"], run["params"])
    # Layer groups from the block list: the embedding, one group per block (layer_group_size 1), the head.
    m = re.match(r"(\d+) layer groups of up to 1 layers", stats["plan"])
    assert m and int(m.group(1)) == 2 + 2, stats["plan"]
    assert stats["prefetched_groups"] > 0 and stats["group_reads"] > 0, stats
    # Every step reads parameters and writes updates through the swap file (the budget holds less than the state).
    assert stats["nvme_read_bytes"] > 0 and stats["nvme_write_bytes"] > 0, stats
    assert run["io_bytes"] and run["io_bytes"][0] > 0 and run["io_bytes"][1] > 0, run["io_bytes"]
    assert len(stats["io_wait_s"]) == STEPS and len(stats["optimizer_apply_s_steps"]) == STEPS
    assert len(run["steps"]) == STEPS and run["losses"][-1] != run["losses"][0], run["losses"]
    # engine.destroy() closed the swap space: no swap file is left behind.
    assert not [f for _, _, files in os.walk(swap) for f in files if f.endswith(".swp")]
