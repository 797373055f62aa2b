"""The planner's model shapes against what transformers builds, and its byte model against DeepSpeed's estimator
and against the swapper's own plan (zero3/plan.py's plan_run)."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from aidaptiv_ds.common.sizes import align_up
from aidaptiv_ds.config import settings as config_settings
from aidaptiv_ds.models import presets as models
from aidaptiv_ds.planner import memory as M
from aidaptiv_ds.planner.deepspeed_estimate import ADDITIONAL_BUFFER_FACTOR, deepspeed_estimate
from aidaptiv_ds.planner.shapes import resolve_shape, shape_of_config


def _meta_model(config):
    with torch.device("meta"):
        return models._model_class(config)(config)


@pytest.mark.parametrize(
    "name",
    [
        "micro",
        "tiny",
        "small",
        "llama2-70b",
        "llama3.1-8b",
        "qwen2.5-7b",
        "micro-moe",
        "olmoe-1b-7b",
        "qwen3-30b-a3b",
        "mixtral-8x7b",
        "gpt-oss-20b",
    ],
)
def test_parameters_in_order_match_transformers(name):
    """Every parameter's size, in model.parameters() order (the order sub-groups and layer groups follow)."""
    model = _meta_model(models.preset_config(name))
    shape = resolve_shape(name)
    assert shape.parameter_numels() == [p.numel() for p in model.parameters()]
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    if shape.is_moe:  # the MoE block is a ZeRO-3 leaf: gathered whole, its router with its experts
        largest_module = max(largest_module, sum(p.numel() for p in model.model.layers[0].mlp.parameters()))
    assert shape.largest_layer_params == largest_module  # DeepSpeed's model_to_params
    assert shape.active_parameters == models.active_parameters(models.preset_config(name))


def test_qwen3_moe_dense_layers_are_counted_as_dense(tmp_path):
    """Qwen3-MoE keeps the layers of mlp_only_layers (and those off decoder_sparse_step) dense."""
    config = models.preset_config("micro-moe")
    config.num_hidden_layers, config.mlp_only_layers, config.decoder_sparse_step = 4, [0], 2
    config.save_pretrained(tmp_path)
    shape = resolve_shape(str(tmp_path))
    assert shape.moe_layers == (1, 3)
    model = _meta_model(config)
    assert shape.parameter_numels() == [p.numel() for p in model.parameters()]
    assert shape.active_parameters == models.active_parameters(config)


def test_moe_plan_is_sized_by_every_expert_and_computes_with_the_active():
    from aidaptiv_ds.planner.render import moe_line

    shape = resolve_shape("qwen3-30b-a3b")
    job = M.Job(shape, 1024, 1, dtype="bf16")
    plan = M.plan_backend("zero3", job, M.Hardware(gpus=1, gpu_mem=80 << 30, host_mem=64 << 30))
    # every expert's weights, gradients and Adam state
    assert plan.gpu["optimizer: Adam moments"] == 8 * shape.num_parameters
    assert M.step_flops(job) < 6 * 1024 * shape.num_parameters / 5  # a token computes with 3.35B of 30.5B
    assert "3.35B of the 30.53B parameters active per token (8 of 128 experts in each of 48 MoE layers)" in moe_line(
        shape
    )


def test_tied_biased_and_gqa_directory_matches_transformers(tmp_path):
    """A local directory's config.json: tied embeddings, attention and MLP biases, GQA, explicit head_dim."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=200,
        vocab_size=300,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    config.save_pretrained(tmp_path)
    shape = resolve_shape(str(tmp_path))
    model = _meta_model(config)
    assert shape.parameter_numels() == [p.numel() for p in model.parameters()]
    assert shape == shape_of_config(shape.name, config)


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("no-such-model", "is not a preset, a local Hugging Face folder"),
    ],
)
def test_unknown_model_says_what_is_accepted(bad, expected):
    with pytest.raises(ValueError, match=expected) as e:
        resolve_shape(bad)
    assert "tiny" in str(e.value)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(ValueError, match="gpt2.*llama"):
        resolve_shape(str(tmp_path))


@pytest.mark.parametrize(
    "params, largest, gpus, nodes",
    [(6_738_415_616, 131_072_000, 1, 1), (68_976_648_192, 262_144_000, 8, 2), (4_719_872, 524_288, 2, 1)],
)
@pytest.mark.parametrize("offload, offload_params", [(False, False), (True, True), (True, False)])
def test_estimator_formula_is_deepspeeds(params, largest, gpus, nodes, offload, offload_params):
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    for zero_init in (True, False):
        ours = deepspeed_estimate(params, largest, gpus, nodes, offload, offload_params, zero_init)
        theirs = stage3.estimate_zero3_model_states_mem_needs(
            params, largest, gpus, nodes, offload, offload_params, zero_init
        )
        assert ours == theirs


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (4, 2)])
def test_model_state_bytes_agree_with_the_estimator(gpus, nodes):
    """bf16 model state: on the GPU (zero3) the estimator's gpu_mem, in host memory (CPU offload) its cpu_mem per
    node; the only difference allowed is ZeRO-3's padding of each partition to the ranks."""
    shape = resolve_shape("llama2-7b")
    hw = M.Hardware(gpus=gpus, nodes=nodes, gpu_mem=80 << 30, host_mem=1 << 40)
    job = M.Job(shape, 512, 1, dtype="bf16")
    slack = 18 * len(shape.parameter_numels())  # at most one padding element per parameter
    state_keys = ("weights", "gradients (fp32)", "optimizer: fp32 master", "optimizer: Adam moments")
    z3 = M.plan_backend("zero3", job, hw)
    state = sum(z3.gpu[k] for k in state_keys + ("gathered largest layer",))
    assert abs(state - z3.deepspeed_estimate["gpu_per_gpu"]) <= slack
    off = M.plan_backend("zero3_cpu_offload", job, hw)
    # cpu_mem is the state of the node's ranks times DeepSpeed's additional_buffer_factor (1.5)
    state = sum(off.host_pinned[k] for k in state_keys) * gpus * ADDITIONAL_BUFFER_FACTOR
    assert abs(state - off.deepspeed_estimate["cpu_per_node"]) <= slack * 1.5 * gpus
    assert off.gpu["gathered largest layer"] == off.deepspeed_estimate["gpu_per_gpu"]


# ------------------------------------------------------------------ the planner's split is the swapper's


def _fake_run(model, world, dtype, budget, layer_group_size, prefetch_depth, chunk):
    """What zero3/plan.py's plan_run reads of a built model: partition records, settings, dtype."""
    elsize = torch.empty((), dtype=dtype).element_size()
    records = {}
    for i, p in enumerate(model.parameters()):
        p.ds_id = i
        records[i] = SimpleNamespace(extent=SimpleNamespace(reserved=align_up(math.ceil(p.numel() / world) * elsize)))
    cfg = SimpleNamespace(
        host_budget_bytes=budget,
        layer_group_size=layer_group_size,
        prefetch_depth=prefetch_depth,
        optimizer_chunk_numel=chunk,
        cache_optimizer_state=True,
        retention_budget=0,
    )
    return SimpleNamespace(cfg=cfg, param_swapper=SimpleNamespace(records=records), model_dtype=dtype)


@pytest.mark.parametrize(
    "name, world, dtype, budget",
    [
        ("micro", 1, torch.float32, 40 << 20),
        ("micro", 2, torch.bfloat16, 12 << 20),
        ("tiny", 1, torch.float32, 290_000_000),
        ("tiny", 2, torch.float32, 145_000_000),
        ("tiny", 1, torch.bfloat16, 64 << 20),
        ("small", 1, torch.float32, 1_130_000_000),
        ("tiny", 1, torch.float32, 20 << 20),
    ],
)  # below the minimum: both refuse, with the same message
def test_planner_budget_split_is_the_swappers(name, world, dtype, budget):
    from aidaptiv_ds.config.ds_config import ConfigError
    from aidaptiv_ds.zero3.plan import plan_run

    model = _meta_model(models.preset_config(name))
    shape = resolve_shape(name)
    chunk = config_settings.auto_chunk(budget)
    runtime = _fake_run(model, world, dtype, budget, 4, 1, chunk)
    parts = M.partition_numels(shape, world)
    subs = M._sub_groups(parts, chunk)
    job = M.Job(shape, 64, 2, dtype="fp32" if dtype == torch.float32 else "bf16", host_budget=budget)
    hw = M.Hardware(gpus=world)
    split, size, group_bytes, planner_subs, _ = M.aidaptiv_split(job, hw, budget)
    assert planner_subs == subs
    try:
        run = plan_run(runtime, model, subs)
    except ConfigError as e:
        assert not split.fits and str(e) == split.shortfall()
        return
    assert split.fits
    assert (run.layer_group_size, run.group_bytes) == (size, group_bytes)
    assert (run.pool_bytes, run.staging_bytes, run.group_slots) == (split.pool, split.minimum, split.slots)
    assert (run.resident_sub_groups, run.resident_bytes) == (split.resident, split.resident_bytes)


def test_measured_pinned_pool_of_a_committed_run():
    """bench/results/cpu_small/xeon: tiny, aidaptiv, 1 rank, budget 290,000,000 bytes pinned 275.5 MiB (peak_pinned_mb)."""
    from helpers import REPO

    rows = [json.loads(line) for line in open(f"{REPO}/bench/results/cpu_small/xeon/results.jsonl")]
    row = next(r for r in rows if r["key"] == "tiny__aidaptiv__g1__mb2__s64__ga1")
    job = M.Job(resolve_shape("tiny"), 64, 2, dtype="fp32", host_budget=row["aidaptiv_host_budget_bytes"])
    plan = M.plan_backend("aidaptiv", job, M.Hardware(gpus=1, host_mem=5 << 30))
    assert abs(sum(plan.host_pinned.values()) / 2**20 - row["peak_pinned_mb"]) / row["peak_pinned_mb"] < 0.01


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("budget", [20 << 20, 290_000_000, 8 << 30, 200 << 30])
def test_aidaptiv_reduce_bucket_is_the_translated_configs(budget, on_host, tmp_path):
    from aidaptiv_ds.config import translate

    settings = config_settings.SwapSettings.from_block(
        {"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": budget}
    )
    cfg = translate.to_deepspeed_config({"zero_optimization": {"stage": 3}}, settings, on_host=on_host)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == M.aidaptiv_reduce_bucket(budget, on_host)


def test_a_budget_just_short_of_the_minimum_does_not_read_as_enough():
    from aidaptiv_ds.common.sizes import MiB
    from aidaptiv_ds.swap.budget_split import BudgetSplit

    split = BudgetSplit(
        budget=24 * MiB,
        prefetch_depth=1,
        slot=int(3.5 * MiB),
        min_slots=3,
        general=int(1.5 * MiB),
        chunk_set=3 * MiB,
        largest_sub_grad=int(1.5 * MiB),
        minimum=24 * MiB + 40_000,
    )
    msg = split.shortfall()
    assert not split.fits
    assert "is 24.0 MiB (25,165,824 bytes) but the run needs at least 24.1 MiB (25,205,824 bytes)" in msg, msg
