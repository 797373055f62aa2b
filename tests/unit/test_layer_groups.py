"""How parameters are cut into layer groups (the prefetch unit). Chunks: test_chunk_layout.py."""

import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

from aidaptiv_ds.zero3.layer_groups import (
    FALLBACK_GROUPS,
    find_block_list,
    partition_into_groups,
)


def llama(layers=6):
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, vocab_size=100
        )
    )


def test_groups_follow_the_blocks_and_cover_every_parameter_once():
    model = llama(6)
    groups = partition_into_groups(model, 4)
    assert [name for name, _ in groups] == [
        "before model.layers",
        "model.layers[0-3]",
        "model.layers[4-5]",
        "after model.layers",
    ]
    ids = [id(p) for _, ps in groups for p in ps]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(ids) == len(set(ids))
    assert groups[0][1][0] is model.model.embed_tokens.weight
    last = {id(p) for p in groups[-1][1]}
    assert id(model.lm_head.weight) in last and id(model.model.norm.weight) in last
    second = {id(p) for p in groups[1][1]}
    assert all(id(p) in second for i in range(4) for p in model.model.layers[i].parameters())


def test_group_size_one_gives_one_group_per_block():
    groups = partition_into_groups(llama(3), 1)
    assert [n for n, _ in groups] == [
        "before model.layers",
        "model.layers[0]",
        "model.layers[1]",
        "model.layers[2]",
        "after model.layers",
    ]


def test_models_without_a_block_list_are_cut_by_size():
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(20)])
    assert find_block_list(model) is None
    groups = partition_into_groups(model, 4)
    assert 1 < len(groups) <= FALLBACK_GROUPS + 1
    assert sum(len(ps) for _, ps in groups) == len(list(model.parameters()))
