"""The checkpoint checks without a training run: what a save refuses (non-finite weights or optimizer state,
padding excepted), what a load refuses (changed or added files), and which tags --resume auto tries."""

from __future__ import annotations

import pytest
import torch

from aidaptiv_ds.job.train_plan import checkpoint_candidates
from aidaptiv_ds.swap import checkpoint_verify as V


def manifest(master_is_parameter=True, state_valid=True, rank=0):
    return {
        "rank": rank,
        "model_dtype": "float32",
        "master_is_parameter": master_is_parameter,
        "parameters": [
            {"name": "w", "shape": [1000 * (rank + 1)], "partition_numel": 1000, "offset": 0},
            {"name": "b", "shape": [10 * (rank + 1)], "partition_numel": 10, "offset": 8192},
        ],
        "sub_groups": [
            {
                "state_keys": ["exp_avg", "exp_avg_sq"],
                "state_valid": state_valid,
                "chunks": [
                    {"offset": 0, "numel": 1010, "part": 4096, "pieces": [["w", 0, 1000, 0], ["b", 0, 10, 1000]]}
                ],
            }
        ],
    }


def block(nbytes, at=None, value=float("nan")):
    data = torch.zeros(nbytes, dtype=torch.uint8)
    if at is not None:
        data[at : at + 4] = torch.tensor([value], dtype=torch.float32).view(torch.uint8)
    return data


def test_a_save_refuses_a_non_finite_weight_and_names_it():
    insp = V.FileInspector("/ck/params.bin", V.param_ranges(manifest()))
    insp.see(0, block(4096))  # finite
    with pytest.raises(
        V.CheckpointDamagedError,
        match=r"non-finite value \(inf\) in parameter b at byte offset 8200: "
        r"the training diverged before this save",
    ):
        insp.see(4096, block(8192, at=8200 - 4096, value=float("inf")))


def test_padding_between_parameters_may_hold_anything():
    insp = V.FileInspector("/ck/params.bin", V.param_ranges(manifest()))
    insp.see(0, block(8192, at=4000 + 4))  # bytes 4000..8191 are padding after w (1000 floats)
    assert len(insp.blocks) == 1


def test_optimizer_state_is_checked_only_once_it_holds_values():
    ranges = V.optim_ranges(manifest(master_is_parameter=False, state_valid=False))
    assert [r[3] for r in ranges] == ["fp32 master of w (chunk 0)", "fp32 master of b (chunk 0)"]
    ranges = V.optim_ranges(manifest(master_is_parameter=True, state_valid=True))
    assert [(r[0], r[1], r[3]) for r in ranges] == [
        (0, 4000, "exp_avg of w (chunk 0)"),
        (4000, 40, "exp_avg of b (chunk 0)"),
        (4096, 4000, "exp_avg_sq of w (chunk 0)"),
        (8096, 40, "exp_avg_sq of b (chunk 0)"),
    ]
    insp = V.FileInspector("/ck/optim.bin", ranges)
    with pytest.raises(V.CheckpointDamagedError, match=r"exp_avg_sq of w \(chunk 0\) at byte offset 4100"):
        insp.see(0, block(8192, at=4100))


def test_zero_padding_and_packed_quantized_data_are_not_values():
    """The last rank's partitions end in ZeRO's padding (left as the buffer held it) and a QLoRA base holds
    packed 4-bit data: neither is checked for NaN (the CRC still covers their bytes)."""
    m = manifest(rank=1)
    m["parameters"][0]["shape"] = [1500]  # rank 1 holds elements 1000..1499: 500 values, 500 padding
    assert [(r[0], r[1]) for r in V.param_ranges(m)] == [(0, 2000), (8192, 40)]
    insp = V.FileInspector("/ck/params.bin", V.param_ranges(m))
    insp.see(0, block(8192, at=2000 + 8))  # NaN in the padding: not refused
    m["parameters"][0]["values"] = False
    assert [r[3] for r in V.param_ranges(m)] == ["parameter b"]
    assert all("of w" not in r[3] for r in V.optim_ranges(m))


def test_tag_checksums_refuse_a_changed_or_an_added_file(tmp_path):
    tag = tmp_path / "step2"
    (tag / "aidaptiv" / "rank0").mkdir(parents=True)
    (tag / "hf").mkdir()
    (tag / "model_states.pt").write_bytes(b"x" * 100)
    (tag / "hf" / "config.json").write_text("{}")  # written after the save: not listed, not refused
    assert V.verify_tag_files(str(tag)) is False  # no checksums yet: an older checkpoint, not refused
    V.write_tag_checksums(str(tag))
    assert V.verify_tag_files(str(tag)) is True
    (tag / "model_states.pt").write_bytes(b"y" * 100)
    with pytest.raises(V.CheckpointDamagedError, match="is not what its save wrote"):
        V.verify_tag_files(str(tag))
    V.write_tag_checksums(str(tag))
    (tag / "extra_optim_states.pt").write_bytes(b"z")
    with pytest.raises(V.CheckpointDamagedError, match=r"holds files its save did not write \(extra_optim_states.pt\)"):
        V.verify_tag_files(str(tag))


def test_resume_auto_tries_latest_then_the_newest_others(tmp_path):
    for name in ("step2", "step10", "step4", ".step12.saving", "notes"):
        (tmp_path / name).mkdir()
        if name != "notes":
            (tmp_path / name / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("step4")
    assert checkpoint_candidates(str(tmp_path)) == [str(tmp_path / t) for t in ("step4", "step10", "step2")]
    assert checkpoint_candidates(str(tmp_path / "none")) == []
