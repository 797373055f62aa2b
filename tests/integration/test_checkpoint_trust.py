"""A checkpoint is data, not code, and a damaged one does not resume, export or generate as a success.

One aidaptiv run of the micro preset saves at steps 2 and 4; each test damages a copy of that folder as a user
or an attacker might and resumes from it: a pickle payload planted in any of DeepSpeed's .pt files (with its
checksum rewritten too, so only the data-only load stands in the way) does not run, neither through a resume
nor through the scripts DeepSpeed copies into a save folder; a planted file, flipped bytes in params.bin or
optim.bin, NaNs in params.bin and a truncated model_states.pt are each refused with the file and what to do;
``--resume auto`` skips a damaged newest tag, says why, and resumes the one before; ``export`` and
``generate`` refuse the damaged weights resume refuses, and write nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import CONFIGS, child_env, read_metrics, run_train

from aidaptiv_ds.swap.checkpoint_verify import write_tag_checksums

COMMON = ["--model", "micro", "--seq-len", "64", "--warmup", "0", "--no-progress"]
STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
PICKLES = (STATES, OPTIM_STATES)  # every file of a tag that is unpickled (the test below checks there is no other)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step aidaptiv run of the micro preset saved every 2 steps (tags step2, step4; latest is step4)."""
    root = tmp_path_factory.mktemp("trust")
    (root / "swap").mkdir()
    metrics = root / "full.json"
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "aidaptiv.json"),
            *COMMON,
            "--steps",
            "4",
            "--save-dir",
            str(root / "ck"),
            "--save-every",
            "2",
            "--nvme-path",
            str(root / "swap"),
            "--metrics-out",
            str(metrics),
        ],
        cwd=root,
    )
    assert rc == 0, log[-3000:]
    return root, read_metrics(metrics)


def copy_checkpoint(root, name):
    shutil.copytree(root / "ck", root / f"ck_{name}")
    return root / f"ck_{name}"


def resume(root, name, *how):
    """Resume to step 5 from the copy ``ck_<name>`` (``how``: --resume-from TAG, or --resume auto)."""
    metrics = root / f"{name}.json"
    (root / f"swap_{name}").mkdir()
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "aidaptiv.json"),
            *COMMON,
            "--steps",
            "5",
            *how,
            "--nvme-path",
            str(root / f"swap_{name}"),
            "--metrics-out",
            str(metrics),
        ],
        cwd=root,
    )
    return rc, log, read_metrics(metrics) if metrics.exists() else None


class Payload:
    """Unpickling this runs exec(): what a planted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('the payload ran')",))


def plant(tag, marker, name=STATES):
    path = tag / name
    sd = torch.load(path, weights_only=False)  # we wrote it: trusted here
    sd["planted"] = Payload(marker)
    torch.save(sd, path)
    return path


def one_sentence(message):
    """Whether ``message`` is one sentence: no full stop followed by another sentence (paths' dots are not)."""
    return re.search(r"\.\s+[A-Z(]", message) is None


def test_a_payload_planted_with_its_checksum_rewritten_does_not_run(saved):
    root, _ = saved
    tag = copy_checkpoint(root, "planted") / "step4"
    marker = root / "payload_ran"
    states = plant(tag, marker)
    write_tag_checksums(str(tag))  # the attacker rewrites the checksums too
    rc, log, metrics = resume(root, "planted", "--resume-from", str(tag))
    assert not marker.exists(), "the planted payload ran"
    assert rc == 1, log[-3000:]
    assert f"checkpoint file {states} holds objects other than tensors and plain data" in log, log[-3000:]
    assert metrics["status"] == "error"


def test_a_payload_planted_alone_fails_its_checksum(saved):
    root, _ = saved
    tag = copy_checkpoint(root, "planted_only") / "step4"
    marker = root / "payload_ran_2"
    states = plant(tag, marker)
    rc, log, _ = resume(root, "planted_only", "--resume-from", str(tag))
    assert not marker.exists() and rc == 1, log[-3000:]
    assert f"checkpoint file {states} is not what its save wrote" in log, log[-3000:]


def test_every_unpickled_file_of_a_tag_is_one_the_tests_plant_in(saved):
    root, _ = saved
    tag = root / "ck" / "step4"
    found = sorted(
        str(p.relative_to(tag))
        for p in tag.rglob("*")
        if p.is_file() and p.parts[len(tag.parts)] not in ("aidaptiv", "hf")
    )
    assert [f for f in found if f not in ("checksums.json",)] == sorted(PICKLES), found


@pytest.mark.parametrize("name", PICKLES)
def test_resume_auto_refuses_a_payload_planted_in_any_pickle_file(saved, name):
    """DeepSpeed 0.19.8 never reads optim_states.pt on an aidaptiv resume (its optimizer is on NVMe): a payload
    there, checksums rewritten, used to resume as a success and wait for the next tool that unpickles it."""
    root, full = saved
    copy = f"planted_auto_{name[:-3]}"
    ck = copy_checkpoint(root, copy)
    marker = root / f"payload_ran_{name}"
    path = plant(ck / "step4", marker, name)
    write_tag_checksums(str(ck / "step4"))
    rc, log, metrics = resume(root, copy, "--resume", "auto", "--save-dir", str(ck))
    assert not marker.exists(), "the planted payload ran"
    assert rc == 0, log[-3000:]
    skipped = [ln for ln in log.splitlines() if f"--resume auto: skipped {ck / 'step4'}: " in ln]
    assert skipped, log[-3000:]
    message = skipped[0].split(f"skipped {ck / 'step4'}: ", 1)[1]
    assert message.startswith(f"checkpoint file {path} holds objects other than tensors and plain data"), message
    assert one_sentence(message), message
    assert metrics["first_step"] == 2 and metrics["resume_skipped"] == [str(ck / "step4")]
    assert metrics["losses"][2:4] == pytest.approx(full["losses"][2:4], rel=1e-5, abs=0)


# DeepSpeed's scripts, how its users run them, and what they import from them
RECOVERY_SCRIPTS = {
    "zero_to_fp32.py": ([], "from zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as f; f('.')"),
    "zero_to_torch.py": (
        ["--dtype", "float32"],
        "from zero_to_torch import main; main(['.', 'o', '--dtype', 'float32'])",
    ),
}


def test_the_save_folder_ships_no_script_that_unpickles_it(saved):
    """DeepSpeed copies zero_to_fp32.py and zero_to_torch.py into every save folder; run as DeepSpeed's users
    run them (or imported), on a folder with a payload in every pickle file, they must not unpickle anything,
    and must say what converts this folder."""
    root, _ = saved
    ck = copy_checkpoint(root, "scripts")
    marker = root / "payload_ran_scripts"
    for name in PICKLES:
        plant(ck / "step4", marker, name)
    out = root / "scripts_out"
    for script, (extra, use) in RECOVERY_SCRIPTS.items():
        assert (ck / script).is_file(), f"{script} is missing: a user following DeepSpeed's habit finds nothing"
        ran = subprocess.run(
            [sys.executable, str(ck / script), str(ck), str(out), *extra],
            cwd=ck,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        imported = subprocess.run(
            [sys.executable, "-c", use],
            cwd=ck,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert not marker.exists(), f"{script} ran the planted payload"
        for p in (ran, imported):
            assert p.returncode != 0 and "aidaptiv-ds export" in p.stderr, p.stderr[-3000:]
    assert not out.exists()


def test_a_file_added_to_a_tag_is_refused(saved):
    root, _ = saved
    tag = copy_checkpoint(root, "added") / "step4"
    shutil.copy(tag / STATES, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    rc, log, _ = resume(root, "added", "--resume-from", str(tag))
    assert rc == 1 and "holds files its save did not write (zero_pp_rank_1_mp_rank_00_optim_states.pt)" in log, log[
        -3000:
    ]


@pytest.mark.parametrize("name", ["params.bin", "optim.bin"])
def test_flipped_bytes_are_found_with_their_offset(saved, name):
    root, _ = saved
    tag = copy_checkpoint(root, f"flipped_{name}") / "step4"
    path = tag / "aidaptiv" / "rank0" / name
    with open(path, "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0x10]))  # one bit: the value stays finite
    rc, log, _ = resume(root, f"flipped_{name}", "--resume-from", str(tag))
    assert rc == 1, log[-3000:]
    assert f"checkpoint file {path}: bytes 0-" in log and "do not match the checksum written with them" in log, log[
        -3000:
    ]


def test_nans_in_the_weights_are_refused_with_the_parameter_and_offset(saved):
    root, _ = saved
    tag = copy_checkpoint(root, "nan") / "step4"
    folder = tag / "aidaptiv" / "rank0"
    manifest = json.loads((folder / "manifest.json").read_text())
    p = manifest["parameters"][1]
    with open(folder / "params.bin", "r+b") as f:
        f.seek(p["offset"] + 8)
        f.write(torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes())
    rc, log, _ = resume(root, "nan", "--resume-from", str(tag))
    assert rc == 1, log[-3000:]
    assert f"holds a non-finite value (nan) in parameter {p['name']} at byte offset {p['offset'] + 8}" in log, log[
        -3000:
    ]


def nan_in_a_weight(tag):
    """A NaN written into the second parameter of rank 0's params.bin: (file, parameter, byte offset)."""
    folder = tag / "aidaptiv" / "rank0"
    p = json.loads((folder / "manifest.json").read_text())["parameters"][1]
    with open(folder / "params.bin", "r+b") as f:
        f.seek(p["offset"] + 8)
        f.write(torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes())
    return folder / "params.bin", p["name"], p["offset"] + 8


def cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def last_line(p):
    return (p.stderr.strip().splitlines() or [""])[-1]


def test_export_refuses_nans_in_the_weights_and_writes_nothing(saved):
    root, _ = saved
    tag = copy_checkpoint(root, "nan_export") / "step4"
    path, name, offset = nan_in_a_weight(tag)
    out = root / "nan_export_out"
    p = cli("export", str(tag), "--out", str(out), cwd=root)
    assert p.returncode == 1, p.stderr[-3000:]
    message = last_line(p)
    assert message.startswith(
        f"aidaptiv-ds export: checkpoint file {path} holds a non-finite value (nan) in parameter {name} at byte offset "
        f"{offset}: "
    ), message
    assert "export another checkpoint" in message and one_sentence(message), message
    assert not out.exists(), sorted(os.listdir(out))


def test_export_refuses_weights_that_do_not_match_their_checksum(saved):
    """One bit flipped in a value (it stays finite): the CRC32 of its block names the file and byte range."""
    root, _ = saved
    tag = copy_checkpoint(root, "flipped_export") / "step4"
    path = tag / "aidaptiv" / "rank0" / "params.bin"
    with open(path, "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0x10]))
    out = root / "flipped_export_out"
    p = cli("export", str(tag), "--out", str(out), cwd=root)
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"checkpoint file {path}: bytes 0-" in last_line(p), p.stderr[-3000:]
    assert "do not match the checksum written with them" in last_line(p), p.stderr[-3000:]
    assert not out.exists()


def test_generate_refuses_nans_in_the_weights_of_a_checkpoint(saved):
    root, _ = saved
    tag = copy_checkpoint(root, "nan_generate") / "step4"
    path, name, offset = nan_in_a_weight(tag)
    swap = root / "nan_generate_swap"
    swap.mkdir()
    p = cli(
        "generate", "--model", str(tag), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu",
        "--nvme-path", str(swap), cwd=root,
    )  # fmt: skip
    assert p.returncode == 1, p.stderr[-3000:]
    message = last_line(p)
    assert message.startswith(
        f"aidaptiv-ds generate: checkpoint file {path} holds a non-finite value (nan) in parameter {name} at byte "
        f"offset {offset}: "
    ), message
    assert one_sentence(message), message


def test_a_truncated_model_states_is_one_clear_sentence(saved):
    root, _ = saved
    tag = copy_checkpoint(root, "truncated") / "step4"
    states = tag / STATES
    with open(states, "r+b") as f:
        f.truncate(os.path.getsize(states) // 2)
    write_tag_checksums(str(tag))  # as if the save itself had been cut short and listed what it left
    rc, log, _ = resume(root, "truncated", "--resume-from", str(tag))
    assert rc == 1, log[-3000:]
    assert f"checkpoint file {states} cannot be read" in log and "truncated or damaged" in log, log[-3000:]


def test_resume_auto_skips_a_damaged_latest_and_resumes_the_one_before(saved):
    root, full = saved
    ck = copy_checkpoint(root, "auto")
    with open(ck / "step4" / "aidaptiv" / "rank0" / "optim.bin", "r+b") as f:
        f.seek(4096)
        f.write(b"\x00\x01\x02\x03")
    rc, log, metrics = resume(root, "auto", "--resume", "auto", "--save-dir", str(ck))
    assert rc == 0, log[-3000:]
    assert f"--resume auto: skipped {ck / 'step4'}: checkpoint file" in log, log[-3000:]
    assert f"resumed {ck / 'step2'}" in log or "at step 2" in log, log[-3000:]
    assert metrics["first_step"] == 2 and metrics["resume_skipped"] == [str(ck / "step4")]
    # from step 2 the resumed run retraces the uninterrupted one
    assert metrics["losses"][2:4] == pytest.approx(full["losses"][2:4], rel=1e-5, abs=0)


def test_an_untouched_checkpoint_resumes_on_the_same_losses(saved):
    root, full = saved
    tag = copy_checkpoint(root, "clean") / "step2"
    assert (tag / "checksums.json").exists()
    rc, log, metrics = resume(root, "clean", "--resume-from", str(tag))
    assert rc == 0, log[-3000:]
    assert metrics["first_step"] == 2 and metrics["losses"][2:4] == pytest.approx(full["losses"][2:4], rel=1e-5, abs=0)


def test_resuming_another_model_is_one_sentence(saved):
    """The micro checkpoint resumed with --model tiny: refused before DeepSpeed loads anything, in one
    sentence, not DeepSpeed's wall of missing and unexpected keys."""
    root, _ = saved
    tag = copy_checkpoint(root, "other_model") / "step4"
    (root / "swap_other").mkdir()
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "aidaptiv.json"),
            "--model",
            "tiny",
            "--seq-len",
            "64",
            "--warmup",
            "0",
            "--no-progress",
            "--steps",
            "5",
            "--resume-from",
            str(tag),
            "--nvme-path",
            str(root / "swap_other"),
        ],
        cwd=root,
    )
    assert rc == 1, log[-3000:]
    assert f"checkpoint {tag / 'aidaptiv' / 'rank0'} does not fit this run" in log, log[-3000:]
    assert "Missing key" not in log and "Unexpected key" not in log


@pytest.mark.long(
    "one rank's skip of a damaged tag: test_resume_auto_skips_a_damaged_latest_and_resumes_the_one_before"
)
def test_two_ranks_skip_a_tag_only_one_of_them_finds_damaged(tmp_path):
    """Rank 1's params.bin of the newest tag is damaged, rank 0's is not: both ranks refuse it together and
    resume the tag before it (one rank loading step 4 and the other step 2 would train on mixed state)."""
    from helpers import aidaptiv_config, failure_excerpt

    config = aidaptiv_config(tmp_path, host_memory_budget="64MiB")
    common = ["--config", config, *COMMON, "--save-dir", str(tmp_path / "ck")]
    rc, log = run_train([*common, "--steps", "4", "--save-every", "2"], cwd=tmp_path, launcher_procs=2)
    assert rc == 0, failure_excerpt(log)
    with open(tmp_path / "ck" / "step4" / "aidaptiv" / "rank1" / "params.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0x01]))
    metrics = tmp_path / "m.json"
    rc, log = run_train(
        [*common, "--steps", "5", "--resume", "auto", "--metrics-out", str(metrics)], cwd=tmp_path, launcher_procs=2
    )
    assert rc == 0, failure_excerpt(log)
    assert log.count(f"--resume auto: skipped {tmp_path / 'ck' / 'step4'}") >= 1, failure_excerpt(log)
    assert "refused by another rank" in log or "rank1/params.bin" in log
    m = read_metrics(metrics)
    assert m["first_step"] == 2 and m["resume_skipped"] == [str(tmp_path / "ck" / "step4")]
