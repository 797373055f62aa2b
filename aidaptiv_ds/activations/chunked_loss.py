"""A causal LM's loss without its ``tokens x vocabulary`` logits: the LM head and the cross-entropy run one
chunk of tokens at a time, in the forward and again (recomputed) in the backward.

A Hugging Face causal LM computes ``lm_head(hidden)`` for every token, upcasts it to fp32 and takes the
cross-entropy; autograd then keeps those logits and makes their gradient, a second tensor of the same size.
At sequence 12,000 with a 128k vocabulary that is 6 GiB per logits tensor, more than the rest of a small
model's step. :class:`LinearCrossEntropy` holds at most one chunk's fp32 logits (and, in the backward,
their gradient) at a time and saves only the head's input for the backward; the price is one more
``chunk x hidden x vocabulary`` matmul per chunk in the backward (the logits are recomputed).

The numbers are the same as the unchunked loss (Hugging Face's ``ForCausalLMLoss``: labels shifted left by
one, ``-100`` ignored, mean over the counted tokens or sum / ``num_items_in_batch``): per token the same
matmul and the same fp32 log-softmax; only the sums run in another order (fp32: equal to about 1e-7
relative). With one chunk the gradients are the unchunked ones bit for bit (bf16 too); over several, the
head's weight gradient is summed over chunks in fp32 and cast once (bf16: as exact as the unchunked matmul,
but not the same bits).

:func:`install` makes a model compute its loss this way whenever it is called with ``labels`` to train. The head is
still called as a module, once per forward (``head(hidden, labels=...)``), because ZeRO-3 gathers a
partitioned weight only inside calls of its module and re-gathers it for the backward of that call's
output; the weight's gradient is produced once per backward, as before. Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import functools
import types
from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Model families whose logits are exactly lm_head(last hidden state): no soft-capping, no logit scale.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets of each position (the next token; the last position has none), flattened."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)


class LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(linear(hidden, weight, bias).float(), targets)`` summed, divided by ``divisor``, one
    chunk of ``chunk`` rows at a time. hidden: [N, H], targets: [N] (``IGNORE_INDEX`` rows count for
    nothing), divisor: a 0-d tensor."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start : start + chunk], weight, bias).float()
            total += F.cross_entropy(logits, targets[start : start + chunk], ignore_index=IGNORE_INDEX, reduction="sum")
            del logits
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, weight, bias, targets, divisor)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, divisor = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and bias is not None
        # Each chunk's gradient comes from autograd running the unchunked loss's own ops on that chunk (the
        # head's matmul, the fp32 cross-entropy summed, scaled as a mean would be), so one chunk gives the
        # unchunked loss's gradients bit for bit, in bf16 too. Over several chunks the head's weight and bias
        # gradients are summed in fp32 and cast once.
        scale = grad_out.float() / divisor.float()
        w = weight.detach().requires_grad_(need_weight)
        b = bias.detach().requires_grad_(need_bias) if bias is not None else None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        sums = {}
        chunks = range(0, hidden.shape[0], ctx.chunk)
        for start in chunks:
            h = hidden[start : start + ctx.chunk].detach().requires_grad_(need_hidden)
            with torch.enable_grad():
                logits = F.linear(h, w, b).float()
                loss = F.cross_entropy(
                    logits, targets[start : start + ctx.chunk], ignore_index=IGNORE_INDEX, reduction="sum"
                )
            wanted = [
                (name, x)
                for name, x, need in (("h", h, need_hidden), ("w", w, need_weight), ("b", b, need_bias))
                if need
            ]
            grads = torch.autograd.grad(loss, [x for _, x in wanted], grad_outputs=scale)
            del logits, loss
            for (name, _), g in zip(wanted, grads):
                if name == "h":
                    grad_hidden[start : start + ctx.chunk] = g
                elif len(chunks) == 1:
                    sums[name] = g
                elif name in sums:
                    sums[name] += g.float()
                else:
                    sums[name] = g.float()
        grad_weight = sums["w"].to(weight.dtype) if "w" in sums else None
        grad_bias = sums["b"].to(bias.dtype) if "b" in sums else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    chunk_tokens: int,
    num_items_in_batch=None,
) -> torch.Tensor:
    """The loss a Hugging Face causal LM computes from its last hidden state ``hidden`` [B, S, H] and
    ``labels`` [B, S], chunked (see the module docstring)."""
    if chunk_tokens < 1:
        raise ValueError(f"loss chunk of {chunk_tokens} tokens: expected at least 1")
    targets = shift_labels(labels).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        divisor = (targets != IGNORE_INDEX).sum().float()  # a mean over the counted tokens (NaN with none)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    return LinearCrossEntropy.apply(flat, weight, bias, targets, divisor, int(chunk_tokens))


def _head_forward(self, hidden, labels=None, *, loss_chunk_tokens=None, num_items_in_batch=None):
    """An ``nn.Linear`` head's forward; given ``labels``, the chunked loss instead of the logits."""
    if labels is None:
        return F.linear(hidden, self.weight, self.bias)
    return causal_lm_loss(
        hidden, self.weight, self.bias, labels, loss_chunk_tokens or self._aidaptiv_loss_chunk, num_items_in_batch
    )


def loss_owner(model):
    """The module whose forward computes ``model``'s loss: the base model of a PEFT wrapper (its forward runs
    the adapters and then calls the base's, which other libraries patch there: TRL's fused LM head), else
    ``model`` itself."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and hasattr(model, "peft_config"):
        return get_base()
    return model


def unsupported_reason(model) -> Optional[str]:
    """Why :func:`install` cannot apply to ``model`` (None when it can)."""
    model = loss_owner(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (
            f"model type {model_type!r} is not one whose logits are exactly lm_head(hidden) "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if "forward" in vars(model) and not getattr(model, "_aidaptiv_chunked_loss", False):
        # Another library replaced the model's forward and owns its head and loss (TRL's SFTTrainer installs a
        # fused LM head that already works in tiles and returns log_probs its loss needs): leave it be.
        return "its forward was replaced by another library (TRL's fused LM head, for one), which owns the loss"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return "the model has no nn.Linear output head"
    if not hasattr(model, "get_decoder"):
        return "the model has no get_decoder()"
    return None


def install(model, chunk_tokens: int) -> None:
    """Make ``model`` (a Hugging Face causal LM of a supported type) compute its loss in chunks of
    ``chunk_tokens`` tokens whenever it is called with ``labels`` and gradients are enabled (training); it
    then returns no logits. Without labels, or under ``torch.no_grad`` (evaluation), it behaves as before. A
    PEFT model's base model gets the chunked forward (:func:`loss_owner`), below the adapters. Raises
    ValueError for a model it cannot apply to. Idempotent (the chunk size is updated)."""
    if chunk_tokens < 1:
        raise ValueError(f"loss chunk of {chunk_tokens} tokens: expected at least 1")
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the chunked loss cannot apply to {type(model).__name__}: {reason}")
    model = loss_owner(model)
    head = model.get_output_embeddings()
    head._aidaptiv_loss_chunk = int(chunk_tokens)
    if getattr(model, "_aidaptiv_chunked_loss", False):
        return
    head.forward = types.MethodType(_head_forward, head)
    decoder = model.get_decoder()
    original = model.forward

    @functools.wraps(original)  # the same signature for those who inspect it (the HF Trainer does)
    def forward(
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        if labels is None or not torch.is_grad_enabled():
            # Evaluation (no gradient) keeps the model's own forward: callers there may want the logits.
            return original(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.get("num_items_in_batch")
        out = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        loss = head(out.last_hidden_state, labels=labels, num_items_in_batch=num_items)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=out.past_key_values,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    model.forward = forward
    model._aidaptiv_chunked_loss = True


def installed_chunk(model) -> Optional[int]:
    """The chunk size :func:`install` gave ``model``, or None when its loss is not chunked."""
    model = loss_owner(model)
    if not getattr(model, "_aidaptiv_chunked_loss", False):
        return None
    return getattr(model.get_output_embeddings(), "_aidaptiv_loss_chunk", None)


def logits_bytes(tokens: int, vocab: int, chunk_tokens: Optional[int]) -> int:
    """Bytes of fp32 logits and their gradient that exist at once for ``tokens`` tokens: all of them
    unchunked (``chunk_tokens`` None), one chunk's otherwise. Arithmetic from the shapes, for the metrics."""
    rows = tokens if not chunk_tokens else min(tokens, chunk_tokens)
    return 2 * rows * vocab * 4
