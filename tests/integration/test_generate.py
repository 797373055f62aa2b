"""`aidaptiv-ds generate` and `aidaptiv_ds.inference`: weights streamed from the swap space give the in-memory
model's tokens under greedy decoding; each step reads exactly the streamed layers once; the prompt cache on the
SSD gives the same tokens from a prefix read back, and never uses a torn, damaged or stale entry; bad input is
refused with one clear message and leaves nothing behind."""

import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from helpers import child_env, run_train

HIDDEN, LAYERS = 128, 6


def _save_model(folder, tied=False, seed=0, layers=LAYERS, context=2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    from aidaptiv_ds.models.tokenizer import save_byte_tokenizer

    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=512,
        max_position_embeddings=context,
        tie_word_embeddings=tied,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights: logits that depend on the context, not one token repeated
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(str(folder))
    save_byte_tokenizer(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "untied": _save_model(root / "untied"),
        "tied": _save_model(root / "tied", tied=True, seed=1),
        "other": _save_model(root / "other", seed=2, layers=4),
    }


def _swap(tmp_path, name="nvme"):
    """A swap folder for one test: made here, as generate takes an existing folder only."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    return str(folder)


PROMPTS = ["The capital of France is", "Once upon a time, in a land far, far away, there lived"]
BUDGET = "2.5MiB"  # about 0.4 of the 6.1 MiB of weights: two layers in flight, four streamed


def _reference(folder, prompts, new, dtype=torch.float32, prepare=None):
    """Greedy tokens of the in-memory model, the same batch left-padded the same way; ``prepare`` (if given) is
    called with the model before it generates (to hook its modules)."""
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.models.tokenizer import HFTokenizer

    tok = HFTokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    if prepare is not None:
        prepare(model)
    ids = [tok.encode(p, add_bos=True, add_eos=False) for p in prompts]
    width = max(map(len, ids))
    x = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros_like(x)
    for r, t in enumerate(ids):
        x[r, width - len(t) :] = torch.tensor(t)
        mask[r, width - len(t) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    rows = []
    for r in range(len(ids)):
        new_ids = out[r, width:].tolist()
        if tok.eos_token_id in new_ids:
            new_ids = new_ids[: new_ids.index(tok.eos_token_id) + 1]
        rows.append(new_ids)
    return rows


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_streamed_greedy_tokens_are_the_in_memory_models(models, tmp_path, kind):
    from aidaptiv_ds.inference import Generator

    folder = models[kind]
    with Generator(folder, host_budget=BUDGET, nvme_path=_swap(tmp_path), device="cpu") as gen:
        st = gen.stats()
        assert st["slots"] >= 2 and st["streamed_bytes_per_pass"] > st["weight_bytes"] / 2, st
        swap_files = [f for _, _, fs in os.walk(tmp_path / "nvme") for f in fs if f == "weights"]
        assert swap_files, "streamed layers live in the swap space"
        results = gen.generate(PROMPTS, max_new_tokens=12, batch_size=2)
        st = gen.stats()
    assert [r.token_ids for r in results] == _reference(folder, PROMPTS, 12)
    assert len(set(results[1].token_ids)) > 1  # the test model does not repeat one token
    # Each forward pass reads every streamed layer once: (passes) x (streamed bytes), plus the read-ahead
    # of the next pass's first layers that the slots took at the end.
    passes = max(r.new_tokens for r in results)
    per_pass = st["streamed_bytes_per_pass"]
    layers_read = st["bytes_read"] - st["rows_bytes_read"]
    assert passes * per_pass <= layers_read <= passes * per_pass + st["slots"] * st["slot_bytes"], st
    if kind == "untied":  # the input embedding is read by rows: a read of a few pages per pass, not the table
        assert st["by_rows_bytes"] == 512 * HIDDEN * 4 and st["resident_bytes"] < st["weight_bytes"] - per_pass
        # a few pages a pass, far from the table each pass
        assert 0 < st["rows_bytes_read"] < passes * st["by_rows_bytes"] / 4 and st["rows_reads"] > 0
    else:  # a table tied to the head is read whole every step anyway: resident
        assert st["by_rows_bytes"] == 0 and st["rows_bytes_read"] == 0, st
    assert not os.path.exists(tmp_path / "nvme" / "aidaptiv-swap" / "rank0" / "lock")  # closed and cleaned


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_encoded_layers_read_fewer_bytes_and_give_the_same_tokens(models, tmp_path, dtype):
    """With room for a decode buffer beside the slots, the streamed layers are stored encoded (bf16 by default,
    fp32 with --encode-weights on): each pass reads their encoded bytes (a quarter fewer in bf16, an eighth in
    fp32) and the tokens are the in-memory model's; --encode-weights off reads the weights as they are, and
    gives the same tokens."""
    from aidaptiv_ds.inference import Generator

    folder = models["untied"]
    budget = "3MiB" if dtype == "float32" else "1.5MiB"
    ref = _reference(folder, PROMPTS[:1], 10, dtype=getattr(torch, dtype))
    seen = {}
    on = "auto" if dtype == "bfloat16" else "on"
    for encode in (on, "off"):
        with Generator(
            folder, host_budget=budget, nvme_path=_swap(tmp_path, encode), device="cpu", dtype=dtype,
            encode_weights=encode,
        ) as gen:  # fmt: skip
            results = gen.generate(PROMPTS[:1], max_new_tokens=10)
            st = gen.stats()
        assert [r.token_ids for r in results] == ref, encode
        seen[encode] = st
        per_pass = st["streamed_bytes_per_pass"]
        layers_read = st["bytes_read"] - st["rows_bytes_read"]
        passes = results[0].new_tokens
        assert passes * per_pass <= layers_read <= passes * per_pass + st["slots"] * st["slot_bytes"], st
    on, off = seen[on], seen["off"]
    shrink = 0.88 if dtype == "float32" else 0.76
    assert on["streamed_bytes_per_pass"] <= shrink * on["streamed_weight_bytes_per_pass"], on
    assert on["decode_s"] > 0 and on["slot_bytes"] < off["slot_bytes"], (on, off)
    assert off["streamed_bytes_per_pass"] == off["streamed_weight_bytes_per_pass"] and off["decode_s"] == 0, off
    assert on["streamed_bytes_per_pass"] < off["streamed_bytes_per_pass"], (on, off)


def test_encoding_is_not_chosen_when_it_would_read_more(models, tmp_path):
    """A budget with room for two raw slots but not for two encoded ones and a decode buffer: the plan keeps
    the layers as they are rather than failing or reading more. And fp32 layers are encoded only when asked."""
    from aidaptiv_ds.inference import Generator

    folder = models["untied"]
    for budget, encode in ((BUDGET, "on"), ("3MiB", "auto")):
        with Generator(
            folder, host_budget=budget, nvme_path=_swap(tmp_path, encode), device="cpu", encode_weights=encode
        ) as g:
            st = g.stats()
        assert st["streamed_bytes_per_pass"] == st["streamed_weight_bytes_per_pass"] > 0, (encode, st)


def test_encoding_on_cuda_is_refused(models):
    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.inference.generate import GenerationError

    with pytest.raises(GenerationError, match="`encode_weights` on: encoded weights are decoded on the CPU"):
        Generator(models["untied"], device="cuda", encode_weights="on")


def test_bf16_conversion_matches_the_in_memory_bf16_model(models, tmp_path):
    from aidaptiv_ds.inference import Generator

    folder = models["untied"]
    with Generator(folder, host_budget="1.5MiB", nvme_path=_swap(tmp_path), device="cpu", dtype="bfloat16") as g:
        assert g.stats()["streamed_bytes_per_pass"] > 0
        got = [r.token_ids for r in g.generate(PROMPTS[:1], max_new_tokens=8)]
    assert got == _reference(folder, PROMPTS[:1], 8, dtype=torch.bfloat16)


def _mixed_dtypes(source, folder, config_dtype="bfloat16"):
    """``source``'s model as some checkpoints ship one: bf16 weights with the norms kept in fp32, the config
    saying ``config_dtype`` (None: no dtype in it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    mixed = {k: v if k.endswith("norm.weight") else v.to(torch.bfloat16) for k, v in weights.items()}
    assert {v.dtype for v in mixed.values()} == {torch.float32, torch.bfloat16}
    save_file(mixed, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if config_dtype:
        config["dtype"] = config_dtype
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


def test_fp32_norms_beside_bf16_weights_load_as_transformers_loads_them(models, tmp_path):
    """A valid file that mixes dtypes (fp32 norms, bf16 weights; transformers loads it) once crashed generate with
    'expected m1 and m2 to have the same dtype': every tensor now goes into the model's dtype, the config's, as
    transformers 5's from_pretrained does, and the tokens are transformers' own, resident or streamed."""
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.inference import generate as G

    folder = _mixed_dtypes(models["untied"], tmp_path / "mixed")
    loaded = AutoModelForCausalLM.from_pretrained(folder)  # its default dtype "auto": the config's
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    ref = _reference(folder, PROMPTS[:1], 8, dtype="auto")
    for budget, nvme in (("64MiB", None), ("1.5MiB", _swap(tmp_path))):
        with Generator(folder, host_budget=budget, nvme_path=nvme, device="cpu") as gen:
            assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}
            assert (gen.stats()["streamed_bytes_per_pass"] > 0) == (nvme is not None)
            assert [r.token_ids for r in gen.generate(PROMPTS[:1], max_new_tokens=8)] == ref
    # Without a dtype in the config transformers takes the first floating-point tensor's (by name, in the first
    # file): here model.embed_tokens.weight, bf16.
    bare = _mixed_dtypes(models["untied"], tmp_path / "bare", config_dtype=None)
    with Generator(bare, host_budget="64MiB", device="cpu") as gen:
        assert G.load_dtype(gen.source, gen.config) == torch.bfloat16
        assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}
    # One dtype in the file: laid out as stored, as before.
    with Generator(models["untied"], host_budget="64MiB", device="cpu") as gen:
        assert G.load_dtype(gen.source, gen.config) is None


def _rewrite_header(path, edit):
    """The safetensors file at ``path`` with its header changed by ``edit(header)`` and its data kept."""
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def test_a_damaged_or_forged_weight_file_is_refused_naming_the_file_and_the_tensor(models, tmp_path):
    """What the safetensors library refuses, refused here before a byte is laid out, with the file and the
    tensor: offsets that overlap (a file that once ran with one norm read from another's bytes), offsets past the
    end (a truncated file), a size that is not dtype x shape, bytes no tensor owns, a header that is not JSON."""
    import shutil

    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.inference.sources import ModelSourceError

    def copy(name):
        folder = tmp_path / name
        shutil.copytree(models["untied"], folder)
        return str(folder), str(folder / "model.safetensors")

    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"

    def overlap(h):  # b's entry names a's bytes: the same size, read from the wrong place
        h[b]["data_offsets"] = list(h[a]["data_offsets"])

    folder, path = copy("overlap")
    _rewrite_header(path, overlap)
    with pytest.raises(
        ModelSourceError, match=rf"{path}: tensor .*norm.weight's bytes .* overlap tensor .*norm.weight's"
    ):
        Generator(folder, host_budget="64MiB", device="cpu")

    folder, path = copy("truncated")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4096)
    with pytest.raises(ModelSourceError, match=rf"{path}: tensor .* end at .* the file is truncated"):
        Generator(folder, host_budget="64MiB", device="cpu")

    folder, path = copy("shape")
    _rewrite_header(path, lambda h: h[a].update(shape=[HIDDEN // 2]))
    with pytest.raises(ModelSourceError, match=rf"{path}: tensor {a} is F32 \[64\], 256 bytes, but its data_offsets"):
        Generator(folder, host_budget="64MiB", device="cpu")

    folder, path = copy("gap")
    _rewrite_header(path, lambda h: h.pop(a))
    with pytest.raises(ModelSourceError, match=rf"{path}: bytes .* before tensor .* belong to no tensor"):
        Generator(folder, host_budget="64MiB", device="cpu")

    folder, path = copy("not-json")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00\xff{{")
    with pytest.raises(ModelSourceError, match=rf"{path} is not a safetensors file \(its header is not JSON"):
        Generator(folder, host_budget="64MiB", device="cpu")


def test_a_swap_folder_must_exist_on_a_disk_as_for_every_command(models, tmp_path, capsys):
    """generate once made a missing --nvme-path (with its parents: /nonexistent/...) and took tmpfs, which train
    refuses: one rule now (aidaptiv_ds.engine.disk.swap_folder_problem, tests/unit/test_swap_folders.py), said
    before the model is read, and nothing made."""
    from aidaptiv_ds import cli
    from aidaptiv_ds.engine import disk
    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.inference.generate import GenerationError

    for missing in (str(tmp_path / "no" / "such" / "swap"), str(tmp_path / "swap")):  # once made, parents too
        with pytest.raises(GenerationError, match=f"`nvme_path` {missing} does not exist: create it"):
            Generator(models["untied"], host_budget=BUDGET, nvme_path=missing, device="cpu")
        assert not os.path.exists(missing)
    assert os.listdir(tmp_path) == []
    argv = ["generate", "--model", models["untied"], "--prompt", "hi", "--host-budget", BUDGET, "--device", "cpu"]
    assert cli.main([*argv, "--nvme-path", str(tmp_path / "swap")]) == 1
    assert f"aidaptiv-ds generate: --nvme-path {tmp_path}/swap does not exist" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "swap")
    if os.path.isdir("/dev/shm") and disk.mount_of("/dev/shm")["fstype"] == "tmpfs":
        with pytest.raises(GenerationError, match="`nvme_path` /dev/shm is on tmpfs .memory, not a disk."):
            Generator(models["untied"], host_budget=BUDGET, nvme_path="/dev/shm", device="cpu")


def test_embedding_rows_read_from_the_ssd_are_the_tables(tmp_path):
    """Rows of a table whose row size does not divide a 4 KiB page, read as one row, a scattered set, the last
    row, nothing, and the whole table (runs longer than the row buffer, many buffers), equal the saved table; and
    generation with it equals the in-memory model's."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.models.tokenizer import save_byte_tokenizer

    cfg = LlamaConfig(
        hidden_size=200, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=3001, max_position_embeddings=256, bos_token_id=256, eos_token_id=257, pad_token_id=258,
    )  # fmt: skip
    torch.manual_seed(3)
    folder = str(tmp_path / "wide")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    save_byte_tokenizer(folder)
    table = load_file(os.path.join(folder, "model.safetensors"))["model.embed_tokens.weight"]
    with Generator(folder, host_budget="4MiB", nvme_path=_swap(tmp_path), device="cpu") as gen:
        w = gen.weights
        (g,) = w.row_groups
        assert g.row_bytes == 800 and w.row_buffer_bytes < g.nbytes / 8
        for ids in ([7], [0, 5, 6, 7, 900, 901, 2999], [3000], [], list(range(3001))):
            assert torch.equal(w._read_rows(g, ids), table[ids]), ids
        assert w.stats["rows_reads"] > 3001 * 800 // w.row_buffer_bytes  # the whole table took many buffers
        got = [r.token_ids for r in gen.generate(PROMPTS[:1], max_new_tokens=6)]
    assert got == _reference(folder, PROMPTS[:1], 6)


def test_only_the_token_embedding_is_read_by_rows(tmp_path):
    """OPT's positional table is an nn.Embedding too, but its forward takes a mask and offsets, not token ids:
    it stays resident, the token table is read by rows, and the tokens are the in-memory model's."""
    from transformers import OPTConfig, OPTForCausalLM

    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.models.tokenizer import save_byte_tokenizer

    cfg = OPTConfig(
        vocab_size=512, hidden_size=128, word_embed_proj_dim=128, num_hidden_layers=4, ffn_dim=256,
        num_attention_heads=4, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=256,
        eos_token_id=257, pad_token_id=258,
    )  # fmt: skip
    torch.manual_seed(4)
    model = OPTForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    folder = str(tmp_path / "opt")
    model.save_pretrained(folder)
    save_byte_tokenizer(folder)
    with Generator(folder, host_budget="2MiB", nvme_path=_swap(tmp_path), device="cpu") as gen:
        st = gen.stats()
        assert st["slots"] >= 2 and [g.label for g in gen.weights.row_groups] == ["model.decoder.embed_tokens"], st
        got = [r.token_ids for r in gen.generate(PROMPTS, max_new_tokens=8, batch_size=2)]
    assert got == _reference(folder, PROMPTS, 8)


def test_everything_resident_when_it_fits(models, tmp_path):
    from aidaptiv_ds.inference import Generator

    with Generator(models["untied"], host_budget="64MiB", device="cpu") as gen:  # no --nvme-path needed
        st = gen.stats()
        r = gen.generate(PROMPTS[:1], max_new_tokens=4)[0]
    assert st["streamed_bytes_per_pass"] == 0 and st["bytes_read"] == 0
    assert r.new_tokens == 4 and r.time_to_first_token_s > 0


def test_prompt_cache_reuses_a_prefix_and_gives_the_same_tokens(models, tmp_path):
    from aidaptiv_ds.inference import Generator

    folder = models["untied"]
    document = "A long report on the harvest of the year, with every field and every crop listed. " * 12
    kv = str(tmp_path / "kv")
    kw = dict(host_budget=BUDGET, nvme_path=_swap(tmp_path), device="cpu")
    with Generator(folder, kv_cache=kv, kv_host_budget=0, **kw) as gen:
        first = gen.generate([document + "Question: which crop?"], max_new_tokens=8)[0]
        again = gen.generate([document + "Question: which crop?"], max_new_tokens=8)[0]
        other = gen.generate([document + "Question: how wet was it?"], max_new_tokens=8)[0]
        stats = gen.stats()["kv_cache"]
    n_prompt = first.prompt_tokens
    assert first.reused_prefix_tokens == 0
    assert again.reused_prefix_tokens == n_prompt - 1  # all but the last token read back
    assert other.reused_prefix_tokens >= len(document)  # the shared document (bytes = tokens, plus BOS)
    assert stats["hits"] == 2 and stats["bytes_read"] > 0
    fresh = _reference(folder, [document + "Question: which crop?", document + "Question: how wet was it?"], 8)
    assert [first.token_ids, other.token_ids] == [fresh[0][: len(first.token_ids)], fresh[1][: len(other.token_ids)]]
    assert again.token_ids == first.token_ids

    # A process that starts later reads the same entries (on the SSD, not in the first one's memory).
    with Generator(folder, kv_cache=kv, **kw) as gen:
        later = gen.generate([document + "Question: which crop?"], max_new_tokens=8)[0]
    assert later.reused_prefix_tokens == n_prompt - 1 and later.token_ids == first.token_ids


def _entries(kv):
    return [os.path.join(d, f) for d, _, fs in os.walk(kv) for f in fs if f.endswith(".kv")]


def test_prompt_cache_never_uses_a_torn_damaged_or_stale_entry(models, tmp_path):
    from aidaptiv_ds.inference import Generator

    folder = models["untied"]
    prompt = "Remember this sentence well, it will come back again and again. " * 8
    kv = str(tmp_path / "kv")
    kw = dict(host_budget=BUDGET, nvme_path=_swap(tmp_path), device="cpu", kv_cache=kv, kv_host_budget=0)
    with Generator(folder, **kw) as gen:
        base = gen.generate([prompt], max_new_tokens=6)[0]
    (entry,) = _entries(kv)
    good = open(entry, "rb").read()

    # A byte of a block flipped: the CRC catches it; the entry is removed and the prefix computed again.
    damaged = bytearray(good)
    damaged[-100] ^= 0x40
    open(entry, "wb").write(bytes(damaged))
    with Generator(folder, **kw) as gen:
        r = gen.generate([prompt], max_new_tokens=6)[0]
        assert gen.stats()["kv_cache"]["damaged"] == 1
    assert r.reused_prefix_tokens == 0 and r.token_ids == base.token_ids
    assert len(_entries(kv)) == 1  # stored again, whole

    # Torn (shorter than its header says) and a crash's temporary file: neither is read.
    open(entry, "wb").write(good[: len(good) // 2])
    open(os.path.join(os.path.dirname(entry), ".tmp-999999-x.kv"), "wb").write(good)  # writer long gone
    with Generator(folder, **kw) as gen:
        r = gen.generate([prompt], max_new_tokens=6)[0]
    assert r.reused_prefix_tokens == 0 and r.token_ids == base.token_ids
    assert not [f for f in os.listdir(os.path.dirname(entry)) if f.startswith(".tmp-")]

    # The same folder rewritten with other weights (same config): another identity, the entry is not used.
    _save_model(folder + "-changed", seed=7)
    os.replace(os.path.join(folder + "-changed", "model.safetensors"), os.path.join(folder, "model.safetensors"))
    try:
        with Generator(folder, **kw) as gen:
            r = gen.generate([prompt], max_new_tokens=6)[0]
        assert r.reused_prefix_tokens == 0
        assert r.token_ids == _reference(folder, [prompt], 6)[0]
    finally:
        _save_model(folder)  # the module's other tests use the original weights


def test_prompt_cache_evicts_the_entries_used_longest_ago(models, tmp_path):
    from aidaptiv_ds.inference import Generator

    kv = str(tmp_path / "kv")
    prompts = [f"Entry number {i}: " + "words to fill the prompt " * 10 for i in range(3)]
    with Generator(models["untied"], host_budget="64MiB", device="cpu", kv_cache=kv, kv_cache_size="1MiB") as gen:
        for p in prompts:
            gen.generate([p], max_new_tokens=2)
        st = gen.stats()["kv_cache"]
    sizes = [os.path.getsize(e) for e in _entries(kv)]
    assert sum(sizes) <= 1 << 20 and st["evicted"] >= 1, (sizes, st)


def test_bad_inputs_are_refused_with_one_message(models, tmp_path):
    from aidaptiv_ds.inference import Generator
    from aidaptiv_ds.inference.generate import GenerationError
    from aidaptiv_ds.inference.sources import ModelSourceError

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(open(os.path.join(models["untied"], "config.json")).read())
    with pytest.raises(ModelSourceError, match="no model weights"):
        Generator(str(empty))
    (empty / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="pickle files are not read"):
        Generator(str(empty))

    # Another model's weights beside this config.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in os.listdir(models["untied"]):
        src = os.path.join(models["other"] if f == "model.safetensors" else models["untied"], f)
        (mixed / f).write_bytes(open(src, "rb").read())
    with pytest.raises(ValueError, match="weights are of another model"):
        Generator(str(mixed), device="cpu")

    with Generator(models["untied"], host_budget="64MiB", device="cpu") as gen:
        with pytest.raises(GenerationError, match="more than the model's context of 2048 tokens"):
            gen.generate(["x" * 2040], max_new_tokens=16)
    with pytest.raises(ValueError, match="give `nvme_path`"):
        Generator(models["untied"], host_budget=BUDGET, device="cpu")
    with pytest.raises(ValueError, match=r"needs at least .* give `host_budget`"):
        Generator(models["untied"], host_budget="1MiB", nvme_path=_swap(tmp_path, "n"), device="cpu")


def _generate_cli(args, cwd, limit_file_bytes=None):
    def limit():
        if limit_file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    return subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", "generate", *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit,
    )


def test_command_writes_metrics_and_a_full_disk_leaves_nothing_behind(models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    metrics = tmp_path / "m.json"
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    common = ["--model", models["untied"], "--host-budget", BUDGET, "--nvme-path", str(nvme), "--device", "cpu"]
    p = _generate_cli(
        [*common, "--prompts", str(prompts), "--max-new-tokens", "5", "--metrics-out", str(metrics)], tmp_path
    )
    assert p.returncode == 0, p.stderr
    m = json.load(open(metrics))
    assert [r["new_tokens"] for r in m["results"]] == [5, 5]
    assert m["results"][0]["token_ids"] == _reference(models["untied"], PROMPTS, 5)[0]
    assert m["stats"]["bytes_read"] >= 5 * m["stats"]["streamed_bytes_per_pass"] > 0
    assert "tokens/s" in p.stderr and "first token after" in p.stderr

    # No file may grow past 1 MiB (as a full disk refuses the swap file's growth): one message, exit 1,
    # and the swap folder is left empty.
    p = _generate_cli([*common, "--prompt", "hi"], tmp_path, limit_file_bytes=1 << 20)
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("aidaptiv-ds generate:") and "weights" in last, p.stderr
    left = [f for _, _, fs in os.walk(nvme) for f in fs]
    assert left == [], left

    p = _generate_cli(["--model", models["untied"]], tmp_path)
    assert p.returncode == 1 and "no prompt" in p.stderr


@pytest.mark.parametrize("preset", ["micro", "micro-tied"])
def test_generates_from_a_checkpoint_as_from_its_export(tmp_path, preset):
    """A checkpoint of `train` is read in place (its per-rank params.bin), and gives the exported folder's tokens
    (with a tied head too, whose checkpoint holds the embedding only)."""
    from helpers import aidaptiv_config

    from aidaptiv_ds.inference import Generator

    config = aidaptiv_config(tmp_path, host_memory_budget="64MiB")
    rc, log = run_train(
        [
            "--config",
            config,
            "--model",
            preset,
            "--seq-len",
            "64",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--no-progress",
            "--save-dir",
            str(tmp_path / "ck"),
            "--output-dir",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    got = {}
    for name in ("ck", "out"):
        with Generator(str(tmp_path / name), host_budget="64MiB", device="cpu") as g:
            got[name] = g.generate(PROMPTS[:1], max_new_tokens=6)[0].token_ids
    assert got["ck"] == got["out"] == _reference(str(tmp_path / "out"), PROMPTS[:1], 6)[0]


def _weights_for_a_device(folder, tmp_path, host_budget, device_budget):
    """StreamedWeights planned and laid out for a device other than the CPU, with a GPU budget: the device is
    "meta" here (no CUDA needed: the plan and the lay-out are the CUDA path's; only the twins are CUDA's own)."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from aidaptiv_ds.common.sizes import parse_size
    from aidaptiv_ds.inference.sources import open_source
    from aidaptiv_ds.inference.streamed import StreamedWeights

    source = open_source(folder)
    with init_empty_weights():
        model = LlamaForCausalLM(source.config())
    return StreamedWeights(
        model,
        source,
        parse_size(host_budget),
        _swap(tmp_path),
        device="meta",
        device_budget=parse_size(device_budget),
    )


def test_on_a_gpu_layers_go_to_the_gpu_budget_then_host_memory_then_the_swap_file(models, tmp_path):
    from aidaptiv_ds.inference.streamed import DeviceBudgetTooSmall, HostBudgetTooSmall

    # Layers of about 0.96 MiB; every step uses the head and the final norm (about 0.26 MiB); the token table is
    # read by rows. GPU 4 MiB: those, two twins and one resident layer. Host 3.5 MiB: two slots, the row buffer
    # and one layer in pinned memory. The four other layers come from the swap file.
    w = _weights_for_a_device(models["untied"], tmp_path, "3.5MiB", "4MiB")
    try:
        layers = [g for g in w.groups if g.is_layer]
        slot = w.slot_bytes
        assert [g.resident for g in layers] == [True, False, False, False, False, False]
        assert [g.in_host for g in layers] == [False, True, False, False, False, False]
        assert w.slot_count == 2 and slot == max(g.nbytes for g in layers)
        assert w.streamed_bytes == sum(g.nbytes for g in layers[2:]) and w.in_host_bytes == layers[1].nbytes
        assert [g.label for g in w.streamed_groups] == [g.label for g in layers[1:]]
        assert [g.label for g in w.swap_groups] == [g.label for g in layers[2:]]
        on_gpu = w.resident_bytes + 2 * slot
        assert on_gpu <= 4 << 20 and on_gpu + slot > 4 << 20  # one more layer would not fit
        # The host holds no copy of what lives on the GPU: its pinned memory is the slots, rows and in-host layer.
        assert w.pool.capacity == layers[1].nbytes + 2 * slot + w.row_buffer_bytes
        assert w.pool.capacity <= 7 << 19  # the host budget, 3.5 MiB
        assert all(g.buffer is not None and g.buffer.device.type == "meta" for g in w.groups if g.resident)
        assert layers[1].buffer.device.type == "cpu" and layers[1].extent is None
        assert all(g.extent is not None for g in layers[2:])
    finally:
        w.close()
    with pytest.raises(DeviceBudgetTooSmall, match=r"GPU budget .* needs at least .* give `gpu_budget`"):
        _weights_for_a_device(models["untied"], tmp_path, "3.5MiB", "2MiB")
    with pytest.raises(HostBudgetTooSmall, match=r"on CUDA it needs at least .*two pinned slots.* `host_budget`"):
        _weights_for_a_device(models["untied"], tmp_path, "1MiB", "4MiB")
    w = _weights_for_a_device(models["untied"], tmp_path, "1MiB", "64MiB")  # all on the GPU: no slot, no file
    try:
        assert w.slot_count == 0 and w.streamed_bytes == 0 and w.in_host_bytes == 0 and w.space is None
        assert w.resident_bytes == sum(g.nbytes for g in w.groups)
    finally:
        w.close()


def test_gpu_budgets_on_the_cpu_are_refused(models):
    from aidaptiv_ds.inference import Generator

    for kw in (dict(gpu_budget="1GiB"), dict(gpu_mem_cap_gb=2.0)):
        with pytest.raises(ValueError, match=r"`gpu_budget` and `gpu_mem_cap_gb` are for `device` cuda"):
            Generator(models["untied"], host_budget="64MiB", device="cpu", **kw)
