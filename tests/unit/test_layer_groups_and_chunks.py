"""How parameters are cut into layer groups (the prefetch unit) and optimizer sub-groups into chunks."""
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

from aidaptiv_ds.zero3.layer_groups import FALLBACK_GROUPS, find_block_list, partition_into_groups
from aidaptiv_ds.zero3.optimizer_swapper import cut_into_chunks


def llama(layers=6):
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, vocab_size=100))


def test_groups_follow_the_blocks_and_cover_every_parameter_once():
    model = llama(6)
    groups = partition_into_groups(model, 4)
    assert [name for name, _ in groups] == ["before model.layers", "model.layers[0-3]", "model.layers[4-5]",
                                            "after model.layers"]
    ids = [id(p) for _, ps in groups for p in ps]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(ids) == len(set(ids))
    assert groups[0][1][0] is model.model.embed_tokens.weight
    last = {id(p) for p in groups[-1][1]}
    assert id(model.lm_head.weight) in last and id(model.model.norm.weight) in last
    second = {id(p) for p in groups[1][1]}
    assert all(id(p) in second for i in range(4) for p in model.model.layers[i].parameters())


def test_group_size_one_gives_one_group_per_block():
    groups = partition_into_groups(llama(3), 1)
    assert [n for n, _ in groups] == ["before model.layers", "model.layers[0]", "model.layers[1]",
                                      "model.layers[2]", "after model.layers"]


def test_models_without_a_block_list_are_cut_by_size():
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(20)])
    assert find_block_list(model) is None
    groups = partition_into_groups(model, 4)
    assert 1 < len(groups) <= FALLBACK_GROUPS + 1
    assert sum(len(ps) for _, ps in groups) == len(list(model.parameters()))


class Rec:
    def __init__(self, numel, dtype=torch.float32):
        self.numel, self.dtype = numel, dtype


def test_chunks_cover_the_sub_group_and_split_parameters_only_at_4kib():
    recs = [Rec(768), Rec(5000), Rec(3000), Rec(1_000_000), Rec(10)]
    members, off = [], 0
    for r in recs:
        members.append((r, off, r.numel))
        off += r.numel
    chunks = cut_into_chunks(members, 100_000)
    assert sum(n for _, n, _ in chunks) == off
    pos = 0
    covered = {id(r): [] for r in recs}
    for start, n, pieces in chunks:
        assert start == pos and n <= 100_000
        assert sum(p.numel for p in pieces) == n and pieces[0].flat == 0
        for p in pieces:
            covered[id(p.record)].append((p.start, p.numel))
            assert (p.start * 4) % 4096 == 0  # a split inside a parameter falls at 4 KiB of its bytes
        pos += n
    for r in recs:
        spans = sorted(covered[id(r)])
        assert spans[0][0] == 0 and sum(n for _, n in spans) == r.numel
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_bf16_parameters_split_at_4kib_of_bf16_bytes():
    chunks = cut_into_chunks([(Rec(100_000, torch.bfloat16), 0, 100_000)], 30_000)
    starts = [p.start for _, _, ps in chunks for p in ps]
    assert all((s * 2) % 4096 == 0 for s in starts) and len(chunks) == 4
