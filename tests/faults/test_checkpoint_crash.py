"""A process killed (kill -9) at any moment of `engine.save_checkpoint` leaves the previous checkpoint or the
new one loadable, exactly, never a mix and never zeros.

One training run (a small Llama, our swapper, a host budget well under its state, so that parameters and
optimizer state move through the swap files and the checkpoint files take more than one transfer each) saves
three times: tag "a" at step 2 (nothing before it), tag "b" at step 3 (a new tag beside "a"), and tag "b"
again at step 4 (a second save to the tag `latest` names). The test hook AIDAPTIV_DS_TEST_SNAPSHOT_FROM/_TO (tests/crash_hooks.py)
(aidaptiv_ds.common.durable) copies the checkpoint folder at every crash point of the three saves, which is what a
kill -9 at that point leaves (every write before the point has completed, nothing else writes there); two
points are also killed for real with AIDAPTIV_DS_TEST_CRASH_AT. A second process, whose engine is the second
model it builds (so DeepSpeed's process-wide parameter ids differ from the saving run's, as in HF Trainer's
resume_from_checkpoint), loads every folder through `latest` and trains two steps: the step it resumes at
must be the previous or the new checkpoint's, and its two losses the uninterrupted run's at that step.
"""

import json
import os
import shutil
import subprocess
import sys

from helpers import CONFIGS, _free_port, child_env

REL = 1e-5  # fp32: the resumed trajectory is the uninterrupted one within this relative error
SAVES = [("a", 2), ("b", 3), ("b", 4)]  # (tag, step) of the three saves

JOB = r"""
import json, os, sys
import torch
import deepspeed
import aidaptiv_ds
import crash_hooks  # tests/crash_hooks.py: the kill and snapshot hooks, from this process's environment
from transformers import LlamaConfig, LlamaForCausalLM

crash_hooks.install_from_env()

mode, config, out = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = json.load(open(config))
deepspeed.init_distributed("gloo")
VOCAB = 256
SAVES = [("a", 2), ("b", 3), ("b", 4)]


def build():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=VOCAB, tie_word_embeddings=False))
    engine, *_ = aidaptiv_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


g = torch.Generator().manual_seed(1)
BATCHES = [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(8)]


def step(engine, i):
    loss = engine(input_ids=BATCHES[i], labels=BATCHES[i]).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


if mode == "train":
    save_dir = sys.argv[4]
    engine = build()
    losses, points = [], []
    for i in range(6):
        losses.append(step(engine, i))
        for tag, at in SAVES:
            if at == i + 1:
                engine.save_checkpoint(save_dir, tag=tag, client_state={"step": at})
                points.append(crash_hooks.points_passed())
    json.dump({"losses": losses, "points": points}, open(out, "w"))
else:
    build()  # a model built before: this process's parameter ids are not the saving run's
    engine = build()
    results = {}
    for folder in sys.argv[4:]:
        path, client = engine.load_checkpoint(folder)
        if path is None:
            results[folder] = None
            continue
        s = client["step"]
        results[folder] = {"step": s, "losses": [step(engine, s), step(engine, s + 1)]}
    json.dump(results, open(out, "w"))
"""


def _config(tmp_path):
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    cfg["aidaptiv"].update(
        nvme_path=str(swap), host_memory_budget="8MiB", layer_group_size=1, optimizer_chunk_numel=32768
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _with_tests_on_path(env):
    """The child imports tests/crash_hooks.py too."""
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + env["PYTHONPATH"]
    return env


def _run(tmp_path, name, *args, **env):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / f"{name}.json"
    p = subprocess.run(
        [sys.executable, str(script), args[0], _config(tmp_path), str(out), *args[1:]],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        env=_with_tests_on_path(
            child_env(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), **env
            )
        ),
    )
    return p, (json.loads(out.read_text()) if out.exists() else None)


def _expected(k, points):
    """Steps a folder killed at crash point k may resume at (None: nothing loadable)."""
    before = [None] + [step for _, step in SAVES]
    for i, last in enumerate(points):
        if k <= last:
            return {before[i], before[i + 1]}
    raise AssertionError(f"point {k} after the last save's {points[-1]}")


def _check(folder, result, allowed, reference, what):
    got = None if result is None else result["step"]
    assert got in allowed, f"{what}: {folder} resumes at step {got}, expected one of {allowed}"
    if result is not None:
        want = reference[got : got + 2]
        assert all(abs(a - b) <= REL * abs(b) for a, b in zip(result["losses"], want)), (
            f"{what}: {folder} at step {got} gives losses {result['losses']}, the uninterrupted run {want}"
        )
    return got


def test_kill_at_every_point_of_a_save_leaves_the_previous_or_the_new_checkpoint(tmp_path):
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    save_dir = tmp_path / "ck"
    p, ref = _run(
        tmp_path,
        "reference",
        "train",
        str(save_dir),
        AIDAPTIV_DS_TEST_SNAPSHOT_FROM=str(save_dir),
        AIDAPTIV_DS_TEST_SNAPSHOT_TO=str(snaps),
    )
    assert p.returncode == 0, p.stdout[-4000:]
    points, losses = ref["points"], ref["losses"]
    labels = {k: (snaps / f"{k}.label").read_text() for k in range(1, points[-1] + 1)}
    # Points before, during and after every file of every save: our data files take several transfers.
    assert sum("copied" in v and "of" in v for v in labels.values()) >= 3 * 4, labels
    assert any("DeepSpeed's" in v for v in labels.values()) and any("exchanged" in v for v in labels.values())

    # Real kill -9 at two points of the last save (a second save to the tag `latest` names): in the middle of
    # our first data file, and between the folder exchange and `latest`.
    last = range(points[1] + 1, points[2] + 1)
    chosen = [
        next(k for k in last if labels[k].startswith("copied")),
        next(k for k in last if "exchanged" in labels[k]),
    ]
    killed = []
    for k in chosen:
        d = tmp_path / f"killed{k}"
        p, _ = _run(tmp_path, f"killed{k}", "train", str(d), AIDAPTIV_DS_TEST_CRASH_AT=str(k))
        assert p.returncode == -9, p.stdout[-3000:]
        killed.append((k, str(d)))

    folders = [str(snaps / str(k)) for k in range(1, points[-1] + 1)] + [d for _, d in killed]
    p, results = _run(tmp_path, "verify", "verify", *folders)
    assert p.returncode == 0, p.stdout[-4000:]
    seen = {}
    for k in range(1, points[-1] + 1):
        folder = str(snaps / str(k))
        got = _check(folder, results[folder], _expected(k, points), losses, f"snapshot at {labels[k]!r}")
        seen.setdefault(_expected(k, points).__repr__(), set()).add(got)
    for k, d in killed:
        _check(d, results[d], _expected(k, points), losses, f"kill -9 at {labels[k]!r}")
    # Every save was seen both before and after it took effect.
    assert all(len(v) == 2 for v in seen.values()), seen
    shutil.rmtree(snaps)  # hundreds of MiB of copies
    print(
        f"crash points checked: {points[-1]} snapshots ({points[0]}, {points[1] - points[0]}, "
        f"{points[2] - points[1]} in the three saves) and {len(killed)} real kills"
    )
