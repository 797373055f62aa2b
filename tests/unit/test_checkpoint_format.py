"""The checkpoint format's reader (aidaptiv_ds.swap.checkpoint_format) on rank folders written here by hand: a
tag found from a save dir, a parameter's bytes gathered from every rank's params.bin, and the refusals the
export and generation share, each of the format's error classes. No DeepSpeed run is needed."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from aidaptiv_ds.swap import checkpoint_format as F


def _write_tag(root, params, world_size, dtype="float16", tag="step3"):
    """``params``: name -> (shape, bytes of the whole parameter); each rank holds an equal slice, padded."""
    esize = F.ELEMENT_BYTES[dtype]
    for r in range(world_size):
        folder = F.rank_dir(root, tag, r)
        os.makedirs(folder)
        entries, blob = [], b""
        for name, (shape, data) in params.items():
            pn = -(-len(data) // esize // world_size)
            padded = data + b"\0" * (pn * world_size * esize - len(data))
            entries.append({"name": name, "shape": shape, "partition_numel": pn, "offset": len(blob)})
            blob += padded[r * pn * esize : (r + 1) * pn * esize]
        with open(os.path.join(folder, F.PARAMS), "wb") as f:
            f.write(blob)
        open(os.path.join(folder, F.OPTIM), "wb").close()  # no optimizer state: "optim_bytes": 0
        manifest = {
            "format": F.FORMAT,
            "rank": r,
            "world_size": world_size,
            "model_dtype": dtype,
            "params_bytes": len(blob),
            "optim_bytes": 0,
            "parameters": entries,
            "sub_groups": [],
        }
        with open(os.path.join(folder, F.MANIFEST), "w") as f:
            json.dump(manifest, f)
    with open(os.path.join(root, F.LATEST), "w") as f:
        f.write(tag)
    return os.path.join(root, tag)


PARAMS = {"w": ([3, 5], bytes(range(30))), "b": ([3], b"abcdef")}


def test_a_parameter_is_the_ranks_slices_in_order_cut_to_its_size(tmp_path):
    tag = _write_tag(str(tmp_path), PARAMS, world_size=2)
    assert F.resolve_checkpoint(str(tmp_path)) == tag and F.resolve_checkpoint(tag) == tag
    ck = F.Checkpoint(tag)
    assert ck.world_size == 2 and ck.dtype == "float16" and list(ck.parameters) == ["w", "b"]
    for name, (shape, data) in PARAMS.items():
        raw = bytearray(ck.nbytes(name))
        F.read_pieces(ck.pieces(name), memoryview(raw), f"parameter {name}")
        assert bytes(raw) == data and ck.parameters[name]["shape"] == shape


def test_a_truncated_file_raises_the_callers_error_naming_it(tmp_path):
    tag = _write_tag(str(tmp_path), PARAMS, world_size=2)
    ck = F.Checkpoint(tag)
    pieces = list(ck.pieces("w"))
    with open(pieces[1][0], "r+b") as f:
        f.truncate(4)

    class Mine(ValueError):
        pass

    with pytest.raises(Mine, match=f"file {pieces[1][0]} ends at byte 4, parameter w needs"):
        F.read_pieces(pieces, memoryview(bytearray(30)), "parameter w", Mine)
    with pytest.raises(F.CheckpointDamagedError, match="truncated or damaged"):
        F.read_pieces(pieces, memoryview(bytearray(30)), "parameter w")


def test_refusals_are_the_formats_errors(tmp_path):
    with pytest.raises(F.CheckpointMismatchError, match="does not exist"):
        F.resolve_checkpoint(str(tmp_path / "nothing"))
    (tmp_path / "plain" / "step1").mkdir(parents=True)
    (tmp_path / "plain" / F.LATEST).write_text("step1")
    with pytest.raises(F.CheckpointMismatchError, match="no aidaptiv/ folder"):
        F.resolve_checkpoint(str(tmp_path / "plain"))

    tag = _write_tag(str(tmp_path / "ck"), PARAMS, world_size=2)
    _write_tag(str(tmp_path / "other"), dict(PARAMS, b=([6], b"abcdefghijkl")), world_size=2)
    rank1 = F.rank_dir(str(tmp_path / "ck"), "step3", 1)
    shutil.rmtree(rank1)
    shutil.copytree(F.rank_dir(str(tmp_path / "other"), "step3", 1), rank1)  # a rank of another save
    with pytest.raises(F.CheckpointMismatchError, match="parameter b differs between rank 0 and rank 1"):
        F.Checkpoint(tag)
    os.remove(os.path.join(rank1, F.PARAMS))
    with pytest.raises(F.CheckpointDamagedError, match="the checkpoint is damaged"):
        F.Checkpoint(tag)


def test_a_ranks_manifest_for_a_load_is_checked_against_the_runs_world_size(tmp_path):
    _write_tag(str(tmp_path), PARAMS, world_size=2)
    folder, manifest = F.read_manifest(str(tmp_path), F.resolve_tag(str(tmp_path), None), 1, world_size=2)
    assert folder == F.rank_dir(str(tmp_path), "step3", 1) and manifest["rank"] == 1
    with pytest.raises(F.CheckpointMismatchError, match="saved by 2 ranks and this run has 4"):
        F.read_manifest(str(tmp_path), "step3", 0, world_size=4)


def test_the_format_module_loads_without_deepspeed():
    """Export and generation read checkpoints with it on machines without the training stack."""
    code = "import sys, aidaptiv_ds.swap.checkpoint_format; print('DS', 'deepspeed' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "DS False" in p.stdout, p.stdout + p.stderr
