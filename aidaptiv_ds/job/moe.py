"""A mixture of experts in the train job: the router's load-balancing loss and what the run says of the model."""

from __future__ import annotations

from typing import Optional, Tuple

from aidaptiv_ds.job.failures import TrainingFailed


def router_loss(spec, setting: Optional[float]) -> Optional[Tuple[dict, str]]:
    """Set up ``spec``'s config to train with its router's load-balancing loss (Switch Transformer's, as
    transformers computes it from ``output_router_logits``) weighted by ``setting`` (``router_aux_loss_coef``),
    else by the model's own: published configs ship with the logits off, which would fine-tune without it and
    let the router collapse onto a few experts. Returns (metrics entry, log line); None for a dense model, where
    the setting is refused."""
    config = spec.config
    if not spec.is_moe:
        if setting is not None:
            raise TrainingFailed(
                f"`router_aux_loss_coef` applies to mixtures of experts, and {spec.name} is a dense model: leave it out"
            )
        return None
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if setting is None else setting
    config.router_aux_loss_coef = coef
    config.output_router_logits = coef > 0
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    info = {
        "experts": experts,
        "experts_per_token": config.num_experts_per_tok,
        "active_params": spec.active_parameters,
        "router_aux_loss_coef": coef,
    }
    line = (
        f"mixture of experts: {config.num_experts_per_tok} of {experts} experts per token, "
        f"{spec.active_parameters / 1e6:,.1f}M of {spec.num_parameters / 1e6:,.1f}M parameters active; "
        + (f"load-balancing loss x {coef:g} added" if coef > 0 else "no load-balancing loss (`router_aux_loss_coef` 0)")
    )
    return info, line
