"""aidaptiv_ds.job.export on checkpoints laid out as aidaptiv saves them (format 2: every rank's ZeRO-3 slice of
each parameter in params.bin, named in manifest.json), made here from a plain model so that no DeepSpeed run
is needed: the exported folder loads with transformers and holds the model's exact weights, in several
shards when asked, through one bounded buffer."""

import json
import os
import re
import tracemalloc

import pytest
import torch

from aidaptiv_ds.job import export, model_files
from aidaptiv_ds.models import presets as models
from aidaptiv_ds.models.tokenizer import ByteTokenizer
from aidaptiv_ds.swap import checkpoint_format


def _fake_checkpoint(root, model, world_size, with_files=True, spec=None):
    """Write <root>/step3/aidaptiv/rank<r>/ as zero3.checkpoint.save lays it out: each parameter flattened, padded
    to a multiple of the world size and cut into equal slices, each slice at a 4 KiB-aligned offset."""
    tag = os.path.join(root, "step3")
    params = list(model.named_parameters())
    for r in range(world_size):
        folder = checkpoint_format.rank_dir(root, "step3", r)
        os.makedirs(folder)
        entries, off = [], 0
        with open(os.path.join(folder, "params.bin"), "wb") as f:
            for name, p in params:
                flat = p.detach().reshape(-1)
                pn = -(-flat.numel() // world_size)
                padded = torch.zeros(pn * world_size, dtype=flat.dtype)
                padded[: flat.numel()] = flat
                data = padded[r * pn : (r + 1) * pn].contiguous().view(torch.uint8).numpy().tobytes()
                f.seek(off)
                f.write(data)
                entries.append({"name": name, "shape": list(p.shape), "partition_numel": pn, "offset": off})
                off += -(-len(data) // 4096) * 4096
            f.truncate(off)
        manifest = {
            "format": checkpoint_format.FORMAT,
            "rank": r,
            "world_size": world_size,
            "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "params_bytes": off,
            "optim_bytes": 0,
            "parameters": entries,
            "sub_groups": [],
        }
        with open(os.path.join(folder, checkpoint_format.MANIFEST), "w") as f:
            json.dump(manifest, f)
    if with_files:
        model_files.save_model_files(spec, ByteTokenizer(), os.path.join(tag, checkpoint_format.MODEL_FILES))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step3")
    return tag


@pytest.fixture(scope="module")
def micro():
    spec = models.resolve("micro")
    torch.manual_seed(0)
    model = models.build_model(spec, torch.float32).eval()
    return spec, model


@pytest.mark.parametrize("world_size", [1, 3])
def test_export_loads_with_transformers_and_gives_the_same_logits(tmp_path, micro, world_size):
    from transformers import AutoModelForCausalLM

    spec, model = micro
    _fake_checkpoint(str(tmp_path / "ck"), model, world_size, spec=spec)
    s = export.export(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert s["files"][0] == "model.safetensors" and "config.json" in s["files"], s
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = torch.randint(0, 259, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert torch.equal(a, b)
    for name, p in model.state_dict().items():
        assert torch.equal(p, loaded.state_dict()[name]), name


def test_small_shards_are_indexed_and_memory_stays_at_one_buffer(tmp_path, micro, monkeypatch):
    from safetensors import safe_open

    spec, model = micro
    _fake_checkpoint(str(tmp_path / "ck"), model, 2, spec=spec)
    monkeypatch.setattr(export, "COPY_BUFFER", 256 * 1024)
    total = sum(p.numel() * 4 for p in model.parameters())
    tracemalloc.start()
    try:
        s = export.export(str(tmp_path / "ck"), str(tmp_path / "out"), max_shard_size="3MiB")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # 19 MB of weights went through a 256 KiB buffer: the peak is that buffer plus bookkeeping, not a shard
    # (3 MiB) and not the largest tensor (2 MiB).
    assert peak < 256 * 1024 + 512 * 1024, peak
    shards = [f for f in s["files"] if f.endswith(".safetensors")]
    assert len(shards) >= 6 and s["bytes"] == total, s
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == {n for n, _ in model.named_parameters()}
    for shard in shards:
        assert (
            os.path.getsize(tmp_path / "out" / shard) <= 3 * 2**20 + 4096
            or len([n for n, f in index["weight_map"].items() if f == shard]) == 1
        )
        with safe_open(str(tmp_path / "out" / shard), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                assert torch.equal(f.get_tensor(name), dict(model.named_parameters())[name].detach())


def test_bf16_weights_keep_their_dtype(tmp_path, micro):
    from safetensors.torch import load_file

    spec, model = micro
    bf = models.build_model(spec, torch.bfloat16)
    _fake_checkpoint(str(tmp_path / "ck"), bf, 2, spec=spec)
    export.export(str(tmp_path / "ck" / "step3"), str(tmp_path / "out"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, p in bf.named_parameters():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], p.detach()), name


def test_bf16_export_loads_as_bf16_with_dtype_auto(tmp_path, micro):
    from transformers import AutoModelForCausalLM

    spec, _ = micro
    bf = models.build_model(spec, torch.bfloat16)
    _fake_checkpoint(str(tmp_path / "ck"), bf, 1, with_files=False)
    export.export(str(tmp_path / "ck"), str(tmp_path / "out"), model="micro")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype="auto")
    assert loaded.lm_head.weight.dtype == torch.bfloat16 and torch.equal(loaded.lm_head.weight, bf.lm_head.weight)


def test_an_output_folder_with_weights_is_refused(tmp_path, micro):
    spec, model = micro
    tag = _fake_checkpoint(str(tmp_path / "ck"), model, 1, spec=spec)
    assert export.out_problem(str(tmp_path / "new")) is None
    export.export(tag, str(tmp_path / "out"))
    with pytest.raises(export.ExportError, match="already holds model weights"):
        export.export(tag, str(tmp_path / "out"))


def test_missing_model_files_ask_for_model_and_model_supplies_them(tmp_path, micro):
    spec, model = micro
    _fake_checkpoint(str(tmp_path / "ck"), model, 1, with_files=False)
    with pytest.raises(export.ExportError, match="give `model`"):
        export.export(str(tmp_path / "ck"), str(tmp_path / "out"))
    s = export.export(str(tmp_path / "ck"), str(tmp_path / "out"), model="micro")
    assert "config.json" in s["files"]


def test_a_link_planted_in_the_checkpoints_model_files_is_not_followed(tmp_path, micro):
    """A symbolic link in hf/ (say to a system file, as tokenizer_config.json) would put that file's content
    into the exported model: refused with the link named, and nothing of the target is copied."""
    spec, model = micro
    tag = _fake_checkpoint(str(tmp_path / "ck"), model, 1, spec=spec)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for export")
    planted = os.path.join(tag, checkpoint_format.MODEL_FILES, "tokenizer_config.json")
    os.remove(planted)
    os.symlink(secret, planted)
    with pytest.raises(ValueError, match=f"{planted} is a symbolic link"):
        export.export(tag, str(tmp_path / "out"))
    out_files = os.listdir(tmp_path / "out") if os.path.isdir(tmp_path / "out") else []
    assert all(
        "not for export" not in open(os.path.join(tmp_path / "out", f), errors="replace").read() for f in out_files
    )


def test_refusals_name_the_problem(tmp_path, micro):
    spec, model = micro
    with pytest.raises(export.ExportError, match="does not exist"):
        export.export(str(tmp_path / "nothing"), str(tmp_path / "out"))
    (tmp_path / "plain" / "step1").mkdir(parents=True)
    (tmp_path / "plain" / "latest").write_text("step1")
    with pytest.raises(export.ExportError, match="no aidaptiv/ folder"):
        export.export(str(tmp_path / "plain"), str(tmp_path / "out"))
    tag = _fake_checkpoint(str(tmp_path / "ck"), model, 2, spec=spec)
    with pytest.raises(export.ExportError, match="no LoRA adapters"):
        export.export(tag, str(tmp_path / "out"), merge_lora=True)
    os.remove(os.path.join(checkpoint_format.rank_dir(str(tmp_path / "ck"), "step3", 1), "params.bin"))
    with pytest.raises(export.ExportError, match="damaged"):
        export.export(tag, str(tmp_path / "out"))
    import shutil

    shutil.rmtree(checkpoint_format.rank_dir(str(tmp_path / "ck"), "step3", 1))
    with pytest.raises(export.ExportError, match="copy every rank"):
        export.export(tag, str(tmp_path / "out"))


def _with_checksums(tag, block=64 * 1024):
    """Add to every rank's manifest the CRC32 of each block of its params.bin, as zero3.checkpoint.save records
    them while it writes the file (checking that the weights are finite on the way)."""
    from aidaptiv_ds.swap import checkpoint_verify

    for rank in sorted(os.listdir(os.path.join(tag, checkpoint_format.STATE_DIR))):
        folder = os.path.join(tag, checkpoint_format.STATE_DIR, rank)
        with open(os.path.join(folder, checkpoint_format.MANIFEST)) as f:
            manifest = json.load(f)
        seen = checkpoint_verify.inspectors(folder, manifest)[checkpoint_format.PARAMS]
        with open(os.path.join(folder, checkpoint_format.PARAMS), "rb") as f:
            for offset in range(0, manifest["params_bytes"], block):
                seen.see(offset, torch.frombuffer(bytearray(f.read(block)), dtype=torch.uint8))
        manifest["checksums"] = {"algorithm": checkpoint_verify.ALGORITHM, checkpoint_format.PARAMS: seen.blocks}
        with open(os.path.join(folder, checkpoint_format.MANIFEST), "w") as f:
            json.dump(manifest, f)


def _write_at(tag, rank, offset, data):
    with open(os.path.join(checkpoint_format.rank_dir(os.path.dirname(tag), "step3", rank), "params.bin"), "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_weights_that_a_resume_would_refuse_are_neither_exported_nor_generated_from(tmp_path, micro):
    """A NaN in a weight and a flipped bit (which leaves the value finite) in rank 1's params.bin: export and
    generation refuse each with the file, the parameter and offset or the byte range, and what to do, and the
    export writes nothing; the same checkpoint undamaged exports its exact weights."""
    from safetensors.torch import load_file

    from aidaptiv_ds.inference.sources import ModelSourceError, from_checkpoint

    spec, model = micro
    tag = _fake_checkpoint(str(tmp_path / "ck"), model, 3, spec=spec)
    _with_checksums(tag)
    export.export(tag, str(tmp_path / "good"))
    got = load_file(str(tmp_path / "good" / "model.safetensors"))
    assert all(torch.equal(got[n], p.detach()) for n, p in model.named_parameters())
    assert from_checkpoint(tag).tensors

    ck = checkpoint_format.Checkpoint(tag)
    name = list(ck.parameters)[2]
    offset = ck.parameters[name]["offsets"][1][1] + 12  # (file, offset) of rank 1
    params = checkpoint_format.rank_dir(str(tmp_path / "ck"), "step3", 1) + "/params.bin"
    _write_at(tag, 1, offset, torch.tensor([float("nan")]).numpy().tobytes())
    nan = f"checkpoint file {params} holds a non-finite value (nan) in parameter {name} at byte offset {offset}: "
    with pytest.raises(export.ExportError, match=re.escape(nan) + ".*export another checkpoint"):
        export.export(tag, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelSourceError, match=re.escape(nan) + ".*generate from another checkpoint"):
        from_checkpoint(tag)

    _write_at(tag, 1, offset, torch.tensor([1.5]).numpy().tobytes())  # finite, but not what was saved
    block = offset // (64 * 1024) * (64 * 1024)
    crc = f"checkpoint file {params}: bytes {block}-{block + 64 * 1024} do not match the checksum written with them"
    with pytest.raises(export.ExportError, match=re.escape(crc)):
        export.export(tag, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelSourceError, match=re.escape(crc)):
        from_checkpoint(tag)


def test_a_checkpoint_without_checksums_exports_and_says_it_was_not_verified(tmp_path, micro):
    spec, model = micro
    tag = _fake_checkpoint(str(tmp_path / "ck"), model, 1, spec=spec)
    said = []
    export.export(tag, str(tmp_path / "out"), log=said.append)
    assert (
        f"checkpoint {tag} has no checksums (saved before aidaptiv-ds wrote them): its weights are not verified" in said
    )


def test_plan_shards_puts_an_oversized_tensor_alone():
    assert export.plan_shards({"a": 3, "b": 3, "c": 10, "d": 1}, 6) == [["a", "b"], ["c"], ["d"]]
    assert export.plan_shards({}, 6) == []


def test_the_export_command_imports_no_deepspeed(tmp_path, micro):
    """A 70B export runs on a machine without the training stack's GPU pieces: no DeepSpeed in the process."""
    import subprocess
    import sys

    spec, model = micro
    _fake_checkpoint(str(tmp_path / "ck"), model, 2, spec=spec)
    code = (
        "import sys; from aidaptiv_ds.cli import main; "
        f"rc = main(['export', {str(tmp_path / 'ck')!r}, '--out', {str(tmp_path / 'out')!r}]); "
        "print('DS', 'deepspeed' in sys.modules, rc)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "DS False 0" in p.stdout, p.stdout + p.stderr


def test_presets_byte_tokenizer_loads_with_autotokenizer_and_gives_the_training_ids(tmp_path, micro):
    from transformers import AutoTokenizer

    spec, model = micro
    tag = _fake_checkpoint(str(tmp_path / "ck"), model, 1, spec=spec)
    s = export.export(tag, str(tmp_path / "out"))
    assert "tokenizer.json" in s["files"]
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    byte = ByteTokenizer()
    for text in ("Hello, world!", "  héllo wörld ✓ 中文\n\ttabs", "<s> is text here", ""):
        ids = tok(text)["input_ids"]
        # BOS and the bytes, as training encodes a record before its EOS; a prompt does not end the sequence
        assert ids == byte.encode(text, add_eos=False) and ids[-1:] != [byte.EOS], text
        assert tok.decode(ids, skip_special_tokens=True) == byte.decode(ids)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
