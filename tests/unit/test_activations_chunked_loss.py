"""The chunked LM loss (aidaptiv_ds.activations.chunked_loss): the same loss and gradients as the unchunked Hugging Face
loss, and no tensor of ``tokens x vocabulary`` elements made in the forward or the backward."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from aidaptiv_ds.activations import chunked_loss

REL = 1e-5


def close(a, b, rel=REL):
    scale = b.abs().max().item() or 1.0
    return (a - b).abs().max().item() <= rel * scale


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements any op produced."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def reference_loss(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), chunked_loss.shift_labels(labels), ignore_index=chunked_loss.IGNORE_INDEX
    )


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_loss_and_gradients_equal_the_unchunked_loss_fp32(chunk, with_bias):
    g = torch.Generator().manual_seed(0)
    B, S, H, V = 2, 33, 16, 50
    hidden = torch.randn(B, S, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    bias = torch.randn(V, generator=g, requires_grad=True) if with_bias else None
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 5:9] = chunked_loss.IGNORE_INDEX  # ignored tokens count for nothing
    inputs = [t for t in (hidden, weight, bias) if t is not None]

    ref = reference_loss(hidden, weight, bias, labels)
    ref_grads = torch.autograd.grad(ref * 3.0, inputs)
    ours = chunked_loss.causal_lm_loss(hidden, weight, bias, labels, chunk)
    grads = torch.autograd.grad(ours * 3.0, inputs)

    assert abs(ours.item() - ref.item()) <= REL * abs(ref.item())
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype and close(a, b)


def test_sum_over_num_items_in_batch_as_hugging_face_does():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 20, 8, generator=g, requires_grad=True)
    weight = torch.randn(30, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 30, (1, 20), generator=g)
    ref = (
        F.cross_entropy(
            F.linear(hidden, weight).float().reshape(-1, 30), chunked_loss.shift_labels(labels), reduction="sum"
        )
        / 57
    )
    ours = chunked_loss.causal_lm_loss(hidden, weight, None, labels, 6, num_items_in_batch=torch.tensor(57))
    assert abs(ours.item() - ref.item()) <= REL * abs(ref.item())


def test_no_tensor_of_tokens_times_vocabulary_exists():
    B, S, H, V, chunk = 1, 256, 16, 512, 32
    hidden = torch.randn(B, S, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (B, S))
    with LargestTensor() as seen:
        chunked_loss.causal_lm_loss(hidden, weight, None, labels, chunk).backward()
    assert seen.largest <= chunk * V
    with LargestTensor() as unchunked:
        reference_loss(hidden, weight, None, labels).backward()
    assert unchunked.largest >= S * V  # what the chunking saves: the check can see a full logits tensor


def test_bf16_is_as_close_as_the_unchunked_bf16_loss():
    g = torch.Generator().manual_seed(2)
    hidden32 = torch.randn(2, 64, 256, generator=g)
    weight32 = torch.randn(1000, 256, generator=g) * 0.1
    labels = torch.randint(0, 1000, (2, 64), generator=g)
    exact = reference_loss(hidden32, weight32, None, labels)
    hidden, weight = hidden32.bfloat16().requires_grad_(), weight32.bfloat16().requires_grad_()
    ours = chunked_loss.causal_lm_loss(hidden, weight, None, labels, 16)
    ref = reference_loss(hidden, weight, None, labels)
    # Per token the same bf16 matmul and fp32 cross-entropy: equal to fp32 rounding.
    assert abs(ours.item() - ref.item()) <= REL * abs(ref.item())
    assert abs(ours.item() - exact.item()) <= 1e-2 * abs(exact.item())
    (gw,) = torch.autograd.grad(ours, [weight])
    (rw,) = torch.autograd.grad(ref, [weight])
    assert gw.dtype == torch.bfloat16
    assert close(gw.float(), rw.float(), rel=2e-2)
    # One chunk: the unchunked loss's own ops, so the same bits.
    one = chunked_loss.causal_lm_loss(hidden, weight, None, labels, 10_000)
    assert one.item() == ref.item() or abs(one.item() - ref.item()) <= REL * abs(ref.item())
    got = torch.autograd.grad(one, [hidden, weight])
    want = torch.autograd.grad(reference_loss(hidden, weight, None, labels), [hidden, weight])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _tiny_llama(vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg)


def test_installed_model_gives_the_same_loss_and_gradients():
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 40))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    chunked_loss.install(model, 16)
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    out.loss.backward()
    assert abs(out.loss.item() - ref.item()) <= REL * abs(ref.item())
    for n, p in model.named_parameters():
        assert close(p.grad, ref_grads[n]), n
    # Without labels, or without gradients (evaluation): the model's own forward, logits and all.
    assert model(input_ids=ids).logits.shape == (2, 40, 64)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 40, 64) and abs(out.loss.item() - ref.item()) <= REL * abs(ref.item())


def test_install_refuses_a_model_it_cannot_serve():
    class Other(torch.nn.Module):
        config = type("C", (), {"model_type": "gemma2"})()

    with pytest.raises(ValueError, match="gemma2"):
        chunked_loss.install(Other(), 16)
    with pytest.raises(ValueError, match="at least 1"):
        chunked_loss.install(_tiny_llama(), 0)


def test_a_forward_another_library_replaced_is_left_alone():
    """TRL's SFTTrainer replaces the model's forward with a fused LM head that returns log_probs; chunking our
    way on top of it dropped them ('CausalLMOutputWithPast' object has no attribute 'log_probs')."""
    import types as _types

    from transformers import LlamaConfig, LlamaForCausalLM

    from aidaptiv_ds.activations import chunked_loss as _cl

    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
        )
    )
    assert _cl.unsupported_reason(model) is None
    model.forward = _types.MethodType(lambda self, **kw: "theirs", model)
    assert "another library" in _cl.unsupported_reason(model)


def _peft(model):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
        ),
    )


def test_a_peft_model_whose_base_forward_another_library_replaced_is_left_alone():
    """TRL's SFTTrainer with peft_config patches the fused LM head into the PEFT model's *base* model; chunking
    the wrapper (whose own forward nobody replaced) went around it and TRL's loss failed with
    'CausalLMOutputWithPast' object has no attribute 'log_probs'."""
    import types as _types

    model = _peft(_tiny_llama())
    base = model.get_base_model()
    base.forward = _types.MethodType(lambda self, **kw: "theirs", base)
    assert "another library" in chunked_loss.unsupported_reason(model)


def test_a_peft_model_is_chunked_below_its_adapters_with_the_same_loss_and_gradients():
    """The chunked loss goes on the base model, so PEFT's own forward (adapters, their scaling) still runs."""
    model = _peft(_tiny_llama())
    with torch.no_grad():  # LoRA B starts at zero: give the adapters a visible effect
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids = torch.randint(0, 64, (2, 40))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    chunked_loss.install(model, 16)
    assert "forward" not in vars(model) and chunked_loss.installed_chunk(model) == 16
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    out.loss.backward()
    assert abs(out.loss.item() - ref.item()) <= REL * abs(ref.item())
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert close(p.grad, ref_grads[n]), n
