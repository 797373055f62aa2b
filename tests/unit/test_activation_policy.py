"""Applying an activation policy to a model (aidaptiv_ds.activations.policy) without the engine: recompute on a
model that is not a Hugging Face one, the refusals, and the plan it reports."""

import pytest
import torch
import torch.nn as nn

from aidaptiv_ds.activations import policy as activation_policy
from aidaptiv_ds.config.settings import ActivationSettings


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        return x + torch.tanh(self.fc(x)) * scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x, scale=0.5)
        return x.square().mean()


def grads(net, x):
    net.zero_grad()
    net(x).backward()
    return [p.grad.clone() for p in net.parameters()]


def test_recompute_wraps_each_block_of_a_plain_model_and_keeps_the_gradients():
    x = torch.randn(4, 16)
    ref = grads(Net(), x)
    net = Net()
    plan = activation_policy.apply(net, ActivationSettings(policy="recompute"))
    assert "3 blocks" in plan["recompute"] and plan["loss_chunk_tokens"] is None and not plan["stored"]
    net.train()
    ours = grads(net, x)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert [b.calls for b in net.blocks] == [2, 2, 2]  # each block ran again in the backward
    with torch.no_grad():
        net(x)  # no checkpoint (and no recompute) without grad
    assert [b.calls for b in net.blocks] == [3, 3, 3]


def test_keep_changes_nothing_and_refusals_say_what_to_do():
    net = Net()
    before = [b.forward for b in net.blocks]
    assert activation_policy.apply(net, ActivationSettings(policy="keep"))["recompute"] is None
    assert [b.forward for b in net.blocks] == before
    with pytest.raises(ValueError, match="no nn.ModuleList of repeated blocks"):
        activation_policy.apply(nn.Linear(4, 4), ActivationSettings(policy="recompute"))
    with pytest.raises(ValueError, match='choose "recompute"'):
        activation_policy.apply(Net(), ActivationSettings(policy="nvme"), make_store=None)


class _NothingStored:
    """What the auto policy asks of its store while it measures: whether a tensor would be stored (here none)."""

    def worth_storing(self, t) -> bool:
        return False


def test_auto_measuring_run_leaves_a_mixtures_router_logits_and_load_balancing_loss_alone():
    # The first training forward runs each block twice (measured, then as a checkpoint); transformers records
    # each router's logits by a hook, so the dropped run must add none: two layers, two sets of logits, and the
    # same loss and gradients as the model without a policy.
    from aidaptiv_ds.models.presets import build_model, resolve

    spec = resolve("micro-moe")
    spec.config.output_router_logits = True
    torch.manual_seed(0)
    ref = build_model(spec, torch.float32).train()
    net = build_model(spec, torch.float32).train()
    net.load_state_dict(ref.state_dict())
    settings = ActivationSettings(policy="auto", budget=1 << 40, nvme_bandwidth=1e9)
    activation_policy.apply(net, settings, make_store=_NothingStored)
    policy = net._aidaptiv_auto_policy
    ids = torch.randint(0, spec.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (ref, net):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append(out)
    assert policy.modes == ["keep", "keep"]  # the plan was made from this forward
    assert len(outs[1].router_logits) == len(outs[0].router_logits) == spec.config.num_hidden_layers
    assert outs[0].aux_loss > 0 and torch.equal(outs[1].aux_loss, outs[0].aux_loss)
    assert torch.equal(outs[1].loss, outs[0].loss)
    for (name, a), b in zip(ref.named_parameters(), net.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
