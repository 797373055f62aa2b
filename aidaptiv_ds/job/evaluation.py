"""The held-out loss of a model under training.

One job: run every held-out sequence (aidaptiv_ds.job.data.EvalBatches) through the engine's forward without
gradients and return the mean token loss over all of them, the same on every rank. All ranks make the same
number of forwards (ZeRO-3 gathers each layer's parameters collectively); a rank's stand-in batch counts with
weight 0. Every held-out sequence is whole (seq_len tokens), so the mean over sequences, weighted by how many
each forward held, is the mean over tokens.
"""

from __future__ import annotations


def evaluate(engine, batches, forward_kwargs: dict | None = None) -> float:
    """The mean held-out token loss; ``forward_kwargs`` go to every forward (a mixture of experts is given
    ``output_router_logits=False`` so that its loss is the language model's alone)."""
    import torch
    import torch.distributed as dist

    was_training = engine.training
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)  # (sum of loss x sequences, sequences)
    try:
        with torch.no_grad():
            for i in range(batches.rounds):
                batch, weight = batches.batch(i)
                loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}, **(forward_kwargs or {})).loss
                total[0] += loss.detach().to(torch.float64) * weight
                total[1] += weight
    finally:
        if was_training:
            engine.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def write_logits(engine, batch: dict, path: str, rank: int) -> None:
    """The trained model's logits on ``batch`` (the first data batch), with its input ids, into ``path`` from rank
    0 (for checking an export against them)."""
    import os

    import torch

    batch = {k: v.to(engine.device) for k, v in batch.items()}
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=batch["input_ids"]).logits
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # checked writable before the run
        torch.save({"input_ids": batch["input_ids"].cpu(), "logits": logits.float().cpu()}, path)
