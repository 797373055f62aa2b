"""What a load refuses before it changes anything: an old-format checkpoint, another world size, damaged
files (aidaptiv_ds.zero3.checkpoint.read_manifest; no DeepSpeed run needed)."""

import json

import pytest

from aidaptiv_ds.zero3 import checkpoint


def _write(tmp_path, manifest, params=0, optim=0):
    folder = tmp_path / "ck" / "t" / "aidaptiv" / "rank0"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "params.bin").write_bytes(b"\1" * params)
    (folder / "optim.bin").write_bytes(b"\1" * optim)
    return str(tmp_path / "ck")


def _manifest(**over):
    m = {
        "format": checkpoint.FORMAT,
        "rank": 0,
        "world_size": 1,
        "params_bytes": 8192,
        "optim_bytes": 4096,
        "parameters": [],
        "sub_groups": [],
    }
    m.update(over)
    return m


def test_format_1_is_refused_with_what_to_do(tmp_path):
    d = _write(tmp_path, {"format": 1, "records": [[0, 0, 10]]})
    with pytest.raises(checkpoint.CheckpointMismatchError) as e:
        checkpoint.read_manifest(d, "t", 0)
    msg = str(e.value)
    assert "format 1" in msg and "process-wide parameter ids" in msg and "reads format 2" in msg, msg


def test_other_world_size_is_refused(tmp_path):
    d = _write(tmp_path, _manifest(world_size=2), 8192, 4096)
    with pytest.raises(checkpoint.CheckpointMismatchError, match="saved by 2 ranks and this run has 1"):
        checkpoint.read_manifest(d, "t", 0)


def test_truncated_file_is_refused_not_read_as_zeros(tmp_path):
    d = _write(tmp_path, _manifest(), 8192, 100)
    with pytest.raises(checkpoint.CheckpointMismatchError, match="optim.bin has 100 bytes, its manifest says 4096"):
        checkpoint.read_manifest(d, "t", 0)


def test_missing_rank_folder_names_the_file(tmp_path):
    (tmp_path / "ck" / "t").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointMismatchError, match="manifest.json is missing"):
        checkpoint.read_manifest(str(tmp_path / "ck"), "t", 0)


def test_complete_manifest_is_read(tmp_path):
    d = _write(tmp_path, _manifest(), 8192, 4096)
    folder, m = checkpoint.read_manifest(d, "t", 0)
    assert folder.endswith("rank0") and m["format"] == checkpoint.FORMAT


def test_missing_tag_is_named(tmp_path):
    with pytest.raises(checkpoint.CheckpointMismatchError, match="does not exist"):
        checkpoint.read_manifest(str(tmp_path), "step9", 0)


def test_partitions_of_no_parameter_are_said_before_a_save_is_tried():
    """engine.aidaptiv_save_problem(): a partition that no parameter of the wrapped model owns (a second model
    built under the same zero.Init) makes every save impossible; the job asks before its first step."""
    import torch

    module = torch.nn.Linear(2, 2)
    module.weight.ds_id, module.bias.ds_id = 0, 1
    assert checkpoint.save_problem(module, {0: None, 1: None}) is None
    problem = checkpoint.save_problem(module, {0: None, 1: None, 7: None})
    assert problem.startswith("1 parameter partitions") and "no checkpoint of this run can be saved" in problem
    with pytest.raises(checkpoint.CheckpointMismatchError, match="build one model per zero.Init"):
        checkpoint.parameter_names(module, {0: None, 7: None})
