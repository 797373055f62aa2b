"""`aidaptiv-ds generate` on mixture-of-experts models larger than the budget: per step and layer only the experts
the routers chose are read (once for a batch), from the model's own files or the swap file, or found in the
expert cache, and greedy tokens are the in-memory model's, for each family transformers 5 fuses experts for
(OLMoE, Qwen3-MoE, Mixtral, gpt-oss; Qwen2-MoE for a shared expert), saved as transformers saves them (one tensor
per expert for all but gpt-oss)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import child_env

PROMPTS = ["The capital of France is", "Once upon a time, in a land far, far away, there lived"]
NEW = 8
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)
# Each family's config with 16 experts, 4 a token: 96 KiB an expert in fp32, experts 4.5 MiB of ~5 MiB.
FAMILIES = {
    "olmoe": ("OlmoeConfig", dict(intermediate_size=128, num_experts=16, num_experts_per_tok=4)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            moe_intermediate_size=128, intermediate_size=256, num_experts=16, num_experts_per_tok=4, mlp_only_layers=[1]
        ),
    ),
    "mixtral": ("MixtralConfig", dict(intermediate_size=128, num_local_experts=16, num_experts_per_tok=4)),
    "gpt_oss": (
        "GptOssConfig",
        dict(intermediate_size=128, num_local_experts=16, num_experts_per_tok=4, layer_types=None, sliding_window=8),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=16, num_experts_per_tok=4),
    ),
}
# Where each family's experts are read from: in place when each expert's slice of a parameter is one run of a
# file (gate and up side by side; gpt-oss's fused tensors, whose small biases lie unevenly against the pages,
# moved within the slot); Mixtral's w1, w2, w3 put down between gate and up: the swap file.
READ_FROM = {"olmoe": "model", "qwen3_moe": "model", "mixtral": "swap", "gpt_oss": "model", "qwen2_moe": "model"}


def _save(folder, family, seed=0):
    import transformers

    from aidaptiv_ds.models.tokenizer import save_byte_tokenizer

    config_class, extra = FAMILIES[family]
    cfg = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights: tokens that depend on the context, and routers that choose
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    model.save_pretrained(str(folder))
    save_byte_tokenizer(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: _save(root / family, family) for family in FAMILIES}


def _swap(tmp_path, name="nvme"):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    return str(folder)


def _reference(folder, prompts, new, record=None, dtype=torch.float32):
    """Greedy tokens of the in-memory model on the same left-padded batch (test_generate's reference); with
    ``record`` (a list), the distinct experts of each call of each experts module are appended to it."""
    from test_generate import _reference as reference

    def hook_experts(model):
        for m in model.modules():
            if hasattr(m, "has_gate") and hasattr(m, "num_experts"):
                m.register_forward_pre_hook(lambda mod, args: record.append(torch.unique(args[1]).numel()))

    return reference(folder, prompts, new, dtype=dtype, prepare=hook_experts if record is not None else None)


# (family, budget): 2.5 MiB keeps the layers' attention resident and caches about 20 of the 48 experts, so a step's
# experts always fit; the smaller budgets stream the layers too and leave the cache the 4 experts a token uses,
# so a step of two prompts runs its tokens in turns.
CASES = [
    ("olmoe", "2.5MiB"),
    ("qwen3_moe", "2.5MiB"),
    ("mixtral", "2.5MiB"),
    ("gpt_oss", "2.5MiB"),
    ("olmoe", "700KiB"),
    ("gpt_oss", "760KiB"),  # read in place: a page for each of an expert's two biases
    ("qwen2_moe", "900KiB"),
]


@pytest.mark.parametrize("family,budget", CASES)
def test_routed_experts_give_the_in_memory_models_tokens(models, tmp_path, family, budget):
    """A batch of two prompts: the tokens are the in-memory model's; every step and layer looks up the union of
    its tokens' experts (once when they fit the cache: as many as the in-memory model's experts modules see),
    and every miss reads that expert alone (one read from the swap file or per-expert tensors; one a parameter
    from gpt-oss's fused tensors)."""
    from aidaptiv_ds.inference import Generator

    folder = models[family]
    seen: list = []
    ref = _reference(folder, PROMPTS, NEW, record=seen)
    with Generator(folder, host_budget=budget, nvme_path=_swap(tmp_path), device="cpu") as gen:
        results = gen.generate(PROMPTS, max_new_tokens=NEW, batch_size=2)
        st = gen.stats()
        sets = gen.weights.expert_sets
        per = {len(s.reads(e)) for s in sets for e in range(s.num_experts)}  # reads an expert
        unit = {s.read_nbytes(e) for s in sets for e in range(s.num_experts)}  # bytes an expert
    assert [r.token_ids for r in results] == ref, family
    assert len(set(results[1].token_ids)) > 1  # the test model does not repeat one token
    ex = st["experts"]
    assert ex["mode"] == "routed" and ex["read_from"] == READ_FROM[family], ex
    assert ex["layers"] == (2 if family == "qwen3_moe" else 3) and ex["top_k"] == 4, ex
    misses = ex["lookups"] - ex["hits"]
    assert ex["steps_pipelined"] > 0, ex  # misses computed as they arrived (the tokens above: the same bits)
    assert len(per) == 1 and misses * per.pop() == ex["reads"], (ex, per)
    assert misses * min(unit) <= ex["bytes_read"] <= misses * max(unit), (ex, unit)
    if budget == "2.5MiB":
        assert st["slots"] == 0 and 16 <= ex["cache_slots"] < ex["experts"], (st, ex)
        assert ex["lookups"] == sum(seen) and ex["hits"] > misses / 4, (ex, sum(seen))
    else:
        assert st["slots"] >= 2 and ex["cache_slots"] == 4, (st, ex)
        assert ex["lookups"] >= sum(seen), (ex, sum(seen))
    assert not os.path.exists(tmp_path / "nvme" / "aidaptiv-swap" / "rank0" / "lock")  # closed and cleaned


def test_experts_of_layers_that_straddle_shards_are_read_in_place(tmp_path):
    """A checkpoint saved in shards smaller than a layer's experts (as published ones are: 4-5 GB shards of
    1-2 GB layers): shards' headers differ in length, so the experts of one file lie otherwise against the pages
    than those of the next, and an expert's tensors may be cut by a shard's end. Every expert is still read in
    place (none copied into the swap file), those that land elsewhere are moved within their slots, and the
    tokens are the in-memory model's."""
    import glob

    from safetensors.torch import load_file, save_file

    from aidaptiv_ds.inference import Generator

    # Shards as the hub's are cut: the tensors in name order (an expert's down, gate and up side by side), a new
    # file when the next tensor would pass the size (transformers 5 itself would group each layer's gates apart
    # from its ups when it shards, but writes one file up to 50 GB by default).
    folder = _save(tmp_path / "sharded", "olmoe")
    whole = load_file(os.path.join(folder, "model.safetensors"))
    os.unlink(os.path.join(folder, "model.safetensors"))
    shards, size = [{}], 0
    for name in sorted(whole):
        nbytes = whole[name].numel() * whole[name].element_size()
        if shards[-1] and size + nbytes > 700_000:
            shards.append({})
            size = 0
        shards[-1][name] = whole[name]
        size += nbytes
    index = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, fname))
    json.dump({"metadata": {}, "weight_map": index}, open(os.path.join(folder, "model.safetensors.index.json"), "w"))
    assert len(glob.glob(os.path.join(folder, "*.safetensors"))) >= 5
    ref = _reference(folder, PROMPTS, NEW)
    with Generator(folder, host_budget="2.5MiB", device="cpu", experts_from="model") as gen:
        sets = gen.weights.expert_sets
        results = gen.generate(PROMPTS, max_new_tokens=NEW, batch_size=2)
        ex = gen.stats()["experts"]
        assert gen.weights.file is None  # nothing in a swap file
    assert [r.token_ids for r in results] == ref
    files = {path for s in sets for reads in s.reads_in_place for path, _, _, _ in reads}
    assert len(files) >= 3, files
    moved = [e for s in sets for e in range(s.num_experts) if s.moves(e)]
    assert moved and ex["read_from"] == "model" and ex["bytes_moved"] > 0, ex
    cut = [e for s in sets for e in range(s.num_experts) if len({path for path, *_ in s.reads(e)}) > 1]
    assert cut, "no expert cut by a shard's end: the test no longer covers one"


def test_moves_within_a_slot_are_ordered_so_none_overwrites_a_source_still_to_move():
    from aidaptiv_ds.inference.expert_units import _move_order

    # Three parameters shifted down by 100 bytes: the lowest first.
    moves = [(2100, 2000, 1000), (100, 0, 1000), (1100, 1000, 1000)]
    assert _move_order(moves) == [(100, 0, 1000), (1100, 1000, 1000), (2100, 2000, 1000)]
    # Shifted up: the highest first.
    assert _move_order([(s + 100, s + 200, n) for s, _, n in moves])[0] == (2200, 2300, 1000)
    # Two that trade places overwrite each other whichever goes first.
    assert _move_order([(0, 1000, 1000), (1000, 0, 1000)]) is None


def test_the_cache_serves_a_second_generation(models, tmp_path):
    """With the attention resident and most experts cached, the same prompt generated again reads far fewer
    experts (the ones it used most are still there) and gives the same tokens."""
    from aidaptiv_ds.inference import Generator

    folder = models["olmoe"]
    with Generator(folder, host_budget="4.5MiB", nvme_path=_swap(tmp_path), device="cpu") as gen:
        st = gen.stats()
        assert st["slots"] == 0 and 36 <= st["experts"]["cache_slots"] < 48, st
        first = gen.generate(PROMPTS[1:], max_new_tokens=NEW)[0]
        one = gen.stats()["experts"]
        again = gen.generate(PROMPTS[1:], max_new_tokens=NEW)[0]
        two = gen.stats()["experts"]
    assert again.token_ids == first.token_ids == _reference(folder, PROMPTS[1:], NEW)[0]
    assert one["reads"] >= 36 and two["reads"] - one["reads"] < one["reads"] / 4, (one, two)
    assert two["hits"] - one["hits"] > 0.8 * (two["lookups"] - one["lookups"]), (one, two)


def test_the_experts_used_most_stay_in_the_cache():
    """Most-used first: an expert used by many tokens outlives a stream of experts used once each, and a
    step's own experts are never evicted for one another."""
    from aidaptiv_ds.inference.expert_cache import ExpertCache
    from aidaptiv_ds.inference.expert_units import ExpertParam, ExpertSet

    class Reads:
        def __init__(self):
            self.count = 0

        def read_async(self, buf, file, offset):
            self.count += 1
            return type("Done", (), {"wait": lambda self: None})()

    module = torch.nn.Module()
    module.num_experts = 8
    s = ExpertSet(0, "experts", module, 8, 2, [ExpertParam("w", "experts.w", (4,), torch.float32, 16)])
    s.use_swap()
    s.extent = type("Extent", (), {"offset": 0})()
    engine = Reads()
    stats = {"reads": 0, "bytes_read": 0, "wait_s": 0.0}
    cache = ExpertCache(
        torch.zeros(3 * 4096, dtype=torch.uint8), 4096, [s], engine, {None: None}, {None: 1 << 40}, stats
    )

    def step(experts, counts):
        cache._load(s, torch.tensor(experts), torch.tensor(counts))
        return all(int(cache.slot_of[0][e]) >= 0 for e in experts)

    assert step([0, 1], [50, 1])  # expert 0: fifty tokens
    for e in range(2, 8):
        assert step([e], [1])
    assert cache.slot_of[0][0] >= 0, "the expert used most was evicted"
    assert engine.count == 8 and stats["expert_hits"] == 0
    assert step([0, 7], [1, 1]) and engine.count == 8  # both still held: hits
    assert step([5, 4], [1, 1]) and cache.slot_of[0][0] >= 0  # the two misses took 6's and 7's slots
    assert step([1, 2, 3], [1, 1, 1])  # a step's own experts never evict one another, even expert 0
    assert cache.slot_of[0][0] < 0 and engine.count == 13
    assert stats["expert_lookups"] == 2 + 6 + 2 + 2 + 3 and stats["expert_hits"] == 2, stats
    assert stats["expert_reads"] == stats["reads"] == 13 and stats["expert_bytes_read"] == 13 * 4096, stats


def test_a_failed_expert_read_leaves_no_expert_marked_present(models, tmp_path):
    """A read that fails raises its error, and the experts of that step are not left in the cache as if they had
    arrived: a later generation on the same Generator (as a server goes on after a failed request) reads them
    again and gives the in-memory model's tokens."""
    from aidaptiv_ds.inference import Generator

    folder = models["olmoe"]
    with Generator(folder, host_budget="2.5MiB", nvme_path=_swap(tmp_path), device="cpu") as gen:
        cache = gen.weights.expert_cache
        engine = cache.engine
        real = engine.read_async
        calls = {"n": 0}

        class Failed:
            def wait(self):
                raise OSError(5, "Input/output error (injected)")

        def failing(buf, file, offset):
            calls["n"] += 1
            request = real(buf, file, offset)
            if calls["n"] == 3:  # the third read of the run fails, leaving garbage where its expert was to be
                request.wait()
                buf.fill_(255)
                calls["slot"] = (buf.data_ptr() - cache.pool.data_ptr()) // cache.slot_bytes
                return Failed()
            return request

        engine.read_async = failing
        with pytest.raises(OSError, match="injected"):
            gen.generate(PROMPTS[1:], max_new_tokens=NEW)
        engine.read_async = real
        assert cache.held[calls["slot"]] is None, "the expert whose read failed is still held"
        held = [(slot, h) for slot, h in enumerate(cache.held) if h is not None]
        assert all(int(cache.slot_of[i][e]) == slot for slot, (i, e) in held)  # the map and the slots agree
        again = gen.generate(PROMPTS[1:], max_new_tokens=NEW)[0]
    assert again.token_ids == _reference(folder, PROMPTS[1:], NEW)[0]


def test_whole_experts_stream_with_their_layers_and_give_the_same_tokens(models, tmp_path):
    """--experts whole: every expert with its layer, every step (a dense model's streaming), the same tokens;
    the per-expert tensors of the checkpoint are read as transformers fuses them."""
    from aidaptiv_ds.inference import Generator

    folder = models["mixtral"]
    with Generator(folder, host_budget="3.5MiB", nvme_path=_swap(tmp_path), device="cpu", experts="whole") as gen:
        results = gen.generate(PROMPTS[:1], max_new_tokens=NEW)
        st = gen.stats()
    assert "experts" not in st and st["streamed_weight_bytes_per_pass"] > 1.5 * 2**20, st
    assert results[0].token_ids == _reference(folder, PROMPTS[:1], NEW)[0]


def test_experts_converted_to_bf16_are_read_from_the_swap_file(models, tmp_path):
    """Weights asked for in another dtype than the files': the experts are converted once into the swap file
    (the files do not hold those bytes), and the tokens are the in-memory bf16 model's."""
    from aidaptiv_ds.inference import Generator

    folder = models["olmoe"]
    with Generator(folder, host_budget="1.2MiB", nvme_path=_swap(tmp_path), device="cpu", dtype="bf16") as gen:
        results = gen.generate(PROMPTS, max_new_tokens=NEW, batch_size=2)
        ex = gen.stats()["experts"]
    assert ex["read_from"] == "swap" and ex["weight_bytes"] == 48 * 3 * 64 * 128 * 2 and ex["reads"] > 0, ex
    assert [r.token_ids for r in results] == _reference(folder, PROMPTS, NEW, dtype=torch.bfloat16)


def test_experts_from_the_model_is_refused_where_the_files_do_not_allow_it(models, tmp_path):
    from aidaptiv_ds.inference import Generator

    with pytest.raises(ValueError, match="`experts_from` model: the experts of model.layers.0.mlp.experts"):
        Generator(
            models["mixtral"], host_budget="900KiB", nvme_path=_swap(tmp_path), device="cpu", experts_from="model"
        )
    with Generator(models["olmoe"], host_budget="900KiB", device="cpu", experts_from="model") as gen:
        # In place, and the attention of every layer resident: no swap space at all.
        assert gen.stats()["experts"]["read_from"] == "model" and gen.weights.file is None


def test_command_reports_the_experts_and_chats_with_an_moe_model(models, tmp_path):
    """The command's stderr and --metrics-out say what the experts cost; --chat goes through the tokenizer's
    chat template with nothing that assumes a dense MLP."""
    folder = models["qwen3_moe"]
    config = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    config["chat_template"] = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    json.dump(config, open(os.path.join(folder, "tokenizer_config.json"), "w"))
    metrics = tmp_path / "m.json"
    argv = ["--model", folder, "--host-budget", "2.5MiB", "--nvme-path", _swap(tmp_path), "--device", "cpu"]
    argv += ["--max-new-tokens", "6", "--metrics-out", str(metrics)]
    p = subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", "generate", *argv, "--chat", "--prompt", "Hello there"],
        capture_output=True, text=True, env=child_env(), timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "of experts (32 in 2 layers, 4 a token" in p.stderr and "a cache of" in p.stderr, p.stderr
    assert "read per token, expert cache hit rate" in p.stderr, p.stderr
    m = json.load(open(metrics))
    r = m["results"][0]
    assert r["new_tokens"] == 6 and r["decode_bytes_per_token"] > 0 and 0 <= r["decode_expert_hit_rate"] <= 1
    assert m["stats"]["experts"]["lookups"] > 0 and m["stats"]["experts"]["mode"] == "routed"

    # The studio's Chat tab: one `generate --messages` process a turn, the reply appended to the conversation.
    from aidaptiv_ds.studio import chat

    talk = tmp_path / "talk.json"
    *_, last = chat.turn(folder, talk, "Hello there", max_new_tokens=6, host_budget="2.5MiB", nvme_path=_swap(tmp_path))
    assert [m["role"] for m in last] == ["user", "assistant"] and last == json.loads(talk.read_text())
