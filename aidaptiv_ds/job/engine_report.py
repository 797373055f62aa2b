"""What a training run says about the engine it built, for its log and its metrics: the swapper's I/O settings
and where each came from, the auto activation policy's plan, what the chunked loss saves, and whether DeepSpeed
partitioned the parameters in the dtype the config asks for. Each function reads and returns; the recipe
(:mod:`aidaptiv_ds.job.train`) logs and records."""

from __future__ import annotations

from typing import Optional, Tuple


def io_settings(cfg: dict) -> Optional[Tuple[dict, str]]:
    """The swapper's block size and queue depth and where each came from ("config", "tuned" for the disk by
    'aidaptiv-ds plan --nvme-path', or "default"), as (metrics entry, log line); None without the block's
    settings."""
    from aidaptiv_ds.config import resolve as C

    settings = C.resolve(cfg)[1]  # the settings the swapper got (resolved once per config)
    if settings is None:
        return None
    info = {
        "block_size": settings.block_size,
        "block_size_source": settings.block_size_source,
        "queue_depth": settings.queue_depth,
        "queue_depth_source": settings.queue_depth_source,
    }
    line = (
        f"aidaptiv I/O: block_size {settings.block_size // 1024} KiB ({settings.block_size_source}), "
        f"queue_depth {settings.queue_depth} ({settings.queue_depth_source})"
    )
    return info, line


def activation_plan(engine) -> Optional[str]:
    """The auto activation policy's plan, made during the first forward, rendered (it is also in the metrics
    under activations.plan); None where there is none."""
    stats = engine.aidaptiv_stats() if callable(getattr(engine, "aidaptiv_stats", None)) else None
    plan = ((stats or {}).get("activations") or {}).get("plan")
    if not plan:
        return None
    from aidaptiv_ds.activations.plan import render

    return render(plan)


def partition_dtype_problem(model, dtype) -> Optional[str]:
    """Why the parameters are not in ``dtype`` (None when they are): DeepSpeed 0.19.8's zero.Init drops an
    explicit dtype on CPUs it believes lack fp16 (the start-up hook mends that, but not with
    AIDAPTIV_DS_AUTOLOAD=0) and would partition an fp32 model in bf16."""
    # The parameter's own dtype is what the forward computes in (a partition swapped out to NVMe by
    # ZeRO-Infinity is a placeholder of another dtype, so partitions are not looked at).
    found = {str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()}
    wanted = str(dtype).replace("torch.", "")
    if not found - {wanted}:
        return None
    return (
        f"the config asks for {wanted} but DeepSpeed partitioned parameters in {', '.join(sorted(found))} "
        "(DeepSpeed 0.19.8's zero.Init ignores an explicit dtype on CPUs without fp16 support): keep the "
        "aidaptiv-ds start-up hook on (unset AIDAPTIV_DS_AUTOLOAD), which mends it"
    )


def loss_chunking(model, tokens: int, vocab: int) -> Optional[dict]:
    """What the chunked loss (aidaptiv.activations.loss_chunk_tokens) saves on a micro-batch of ``tokens``, as
    metrics entries; None where it is not installed."""
    from aidaptiv_ds.activations import chunked_loss

    chunk = chunked_loss.installed_chunk(model)
    if chunk is None:
        return None
    return {
        "loss_chunk_tokens": chunk,
        "loss_logits_mb": {
            "unchunked": chunked_loss.logits_bytes(tokens, vocab, None) / 2**20,
            "chunked": chunked_loss.logits_bytes(tokens, vocab, chunk) / 2**20,
        },
    }
