"""Which modules aidaptiv_ds.zero3.moe makes ZeRO-3 leaves: each layer's MoE block in transformers 5's fused layout
(every family the presets cover, built on the meta device), in a per-expert ModuleList layout, partitioned
(ZeRO-3's 1-D partitions keep their shape in ``ds_shape``), and none in a dense model."""

import pytest
import torch
import torch.nn as nn
from deepspeed.utils import z3_leaf_module

from aidaptiv_ds.zero3.moe import mark_moe_blocks, moe_blocks

SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    vocab_size=64,
    num_experts_per_tok=2,
)
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16),
    "olmoe": dict(num_experts=4),
    "mixtral": dict(num_local_experts=4),
    "gpt_oss": dict(num_local_experts=4, layer_types=["full_attention"] * 2),
}


def meta_model(family: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **SMALL, **FAMILIES[family])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_layout_every_layers_block_is_found(family):
    model = meta_model(family)
    assert moe_blocks(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert model.model.layers[0].mlp.experts.gate_up_proj.dim() == 3  # the layout this covers


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)


class PerExpertBlock(nn.Module):
    def __init__(self, experts=4):
        super().__init__()
        self.gate = nn.Linear(8, experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))


class Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = mlp


class Net(nn.Module):
    def __init__(self, make_mlp):
        super().__init__()
        self.layers = nn.ModuleList(Layer(make_mlp()) for _ in range(3))


def test_per_expert_layout_blocks_are_found_and_marked_once():
    net = Net(PerExpertBlock)
    names = [f"layers.{i}.mlp" for i in range(3)]
    assert moe_blocks(net) == names
    assert mark_moe_blocks(net) == names
    assert mark_moe_blocks(net) == names  # idempotent
    leaves = [n for n, m in net.named_modules() if z3_leaf_module(m)]
    assert leaves == names  # the blocks only: not their experts, not the layers, not the model


def test_what_is_not_a_mixture_is_left_alone():
    class Mixed(nn.Module):  # a child called experts that is not a list of experts of one kind
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(8, 8), nn.ReLU()])

    class One(nn.Module):  # one "expert" is a dense MLP
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([Expert()])

    for make in (Mixed, One, lambda: nn.Linear(8, 8)):
        net = Net(make)
        assert moe_blocks(net) == [] and mark_moe_blocks(net) == []
        assert not any(z3_leaf_module(m) for m in net.modules())


def test_dense_preset_has_no_block_and_an_outer_block_hides_an_inner_one():
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.models.presets import preset_config

    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(preset_config("micro"))
    assert moe_blocks(dense) == []

    class Outer(nn.Module):  # a block whose experts hold a block of their own: only the outer one is a leaf
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(PerExpertBlock() for _ in range(2))

    assert moe_blocks(Net(Outer)) == [f"layers.{i}.mlp" for i in range(3)]


@pytest.mark.parametrize("partitioned", [True, False])
def test_partitioned_fused_experts_are_found_by_their_ds_shape(partitioned):
    # Under ZeRO-3 a parameter's data is its 1-D partition; the full shape is kept in ds_shape. A 1-D parameter
    # without it is no expert tensor.
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(0))
            if partitioned:
                self.gate_up_proj.ds_shape = torch.Size([4, 32, 8])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = Experts()

    assert moe_blocks(Net(Block)) == ([f"layers.{i}.mlp" for i in range(3)] if partitioned else [])
