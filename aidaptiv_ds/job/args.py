"""The train job's flags (:func:`add_arguments`), its exit codes and the failures that map to them."""

from __future__ import annotations

import argparse

EXIT_OK, EXIT_ERROR, EXIT_OOM = 0, 1, 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The train job's flags, in the groups ``--help`` shows them in."""
    from aidaptiv_ds.job import train_plan
    from aidaptiv_ds.models.presets import preset_names

    data = p.add_argument_group("model and data")
    schedule = p.add_argument_group("schedule", "how long, how much per step, how fast the weights move")
    memory = p.add_argument_group("memory and swap")
    checkpoints = p.add_argument_group("checkpoints")
    output = p.add_argument_group("output")

    data.add_argument(
        "--config",
        required=True,
        metavar="CONFIG.json",
        help="DeepSpeed config (JSON or hjson), e.g. ds_configs/zero3.json",
    )
    data.add_argument(
        "--model",
        default="tiny",
        metavar="PRESET|HF_DIR",
        help=f"a preset ({', '.join(preset_names())}) with random weights, or a local Hugging Face "
        "model directory (config, weights and tokenizer read from disk). Default: tiny",
    )
    data.add_argument(
        "--data",
        default=None,
        metavar="FILE|DIR",
        help='records (Dolly, Alpaca, prompt/response, chat messages, or {"text"} passages) in a .jsonl, .json, '
        ".csv or .parquet file or a datasets save_to_disk folder; default: the set packaged with "
        "aidaptiv_ds",
    )
    schedule.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps to reach (counting resumed ones); default 10, or with --epochs as many as "
        "the epochs take (with both, whichever ends first)",
    )
    schedule.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence; default 512")
    schedule.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per rank per micro-step (overrides train_micro_batch_size_per_gpu)",
    )
    schedule.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        help="micro-steps per optimizer step (overrides gradient_accumulation_steps)",
    )
    schedule.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's optimizer lr)")
    data.add_argument(
        "--lora",
        default=None,
        metavar="r=R,alpha=A,targets=M1,M2",
        help="train LoRA adapters (PEFT) on a frozen base instead of every weight, e.g. "
        "r=16,alpha=32,targets=q_proj,v_proj (alpha defaults to 2r, targets to q_proj,v_proj; "
        'dropout=P optional). With an "aidaptiv" block the base is streamed read-only from NVMe. '
        "bits=4: QLoRA, the base's linear layers quantised to bitsandbytes nf4 (built whole in RAM "
        "first, then swapped; --output-dir and export write the adapter only)",
    )
    memory.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each transformer block in the backward instead of keeping its activations, as the "
        "Hugging Face Trainer's gradient_checkpointing=True does (the model's "
        "gradient_checkpointing_enable(use_reentrant=False)); the loss is unchanged. With an "
        '"aidaptiv" block it means aidaptiv.activations.policy "recompute" where the block sets none '
        '("recompute", "nvme" and "auto" are kept as set; an explicit "keep" is refused)',
    )
    data.add_argument("--seed", type=int, default=1234, help="seeds weights, data order and RNGs; default 1234")
    data.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="override the config's precision (fp16 needs CUDA)",
    )
    memory.add_argument(
        "--nvme-path", default=None, help="swap directory: replaces nvme_path wherever the config has one"
    )
    memory.add_argument(
        "--create-nvme-path",
        action="store_true",
        help="make --nvme-path on this node (mode 0700, parents too) when it is missing, and remove it "
        "at exit when empty: for a swap folder named by a launcher on another node, as "
        "'aidaptiv-ds sweep' does for cells that span nodes",
    )
    memory.add_argument(
        "--host-budget",
        default=None,
        metavar="SIZE",
        help="aidaptiv only: host memory for staging and caching (bytes, '512MiB', '25%%' of RAM); "
        "overrides the config's aidaptiv.host_memory_budget",
    )
    output.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="first steps left out of medians and NVMe byte counts (timing only; the learning-rate "
        "warm-up is --warmup-steps); default 2 (at least one step is always timed)",
    )
    output.add_argument(
        "--metrics-out", default=None, metavar="FILE.json", help="write the run's metrics here (rank 0)"
    )
    checkpoints.add_argument("--save-dir", default=None, help="write DeepSpeed checkpoints here (tag stepN)")
    checkpoints.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save every N optimizer steps (0: only at the end, when --save-dir is given)",
    )
    output.add_argument(
        "--output-dir",
        default=None,
        metavar="DIR",
        help="aidaptiv backend only: after the last step write the model there in Hugging Face format "
        "(safetensors shards, config.json, tokenizer files; see 'aidaptiv-ds export'), through a "
        "checkpoint in DIR/checkpoint that is removed afterwards unless --save-dir holds it",
    )
    output.add_argument(
        "--logits-out",
        default=None,
        metavar="FILE.pt",
        help="after training, save the model's logits on rank 0's first batch ({'input_ids', "
        "'logits'} with torch.save): to check an exported model against the trained one",
    )
    checkpoints.add_argument(
        "--resume-from",
        default=None,
        metavar="DIR",
        help="a --save-dir (resumes its latest tag) or one tag directory in it (see also --resume auto)",
    )
    memory.add_argument(
        "--keep-swap",
        action="store_true",
        help="keep DeepSpeed's NVMe swap files after the run (default: each rank removes its own; "
        "checkpoints carry their own copy)",
    )
    memory.add_argument(
        "--gpu-mem-cap-gb",
        type=float,
        default=None,
        help="cap this process's CUDA memory (torch.cuda.set_per_process_memory_fraction)",
    )
    memory.add_argument(
        "--no-fit-check",
        action="store_true",
        help="start even when the plan says the swap space, host budget or host memory cannot hold the "
        "job (the problems are printed as a warning): to measure where it really runs out, as "
        "bench/capacity.py does",
    )
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    output.add_argument("-v", "--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    # epochs, held-out evaluation and the lr schedule; --resume auto
    train_plan.add_arguments(data=data, schedule=schedule, checkpoints=checkpoints)
    # The deepspeed launcher passes --local_rank=N (we read LOCAL_RANK from the environment instead).
    p.add_argument("--local_rank", "--local-rank", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class TrainingFailed(Exception):
    """A failure that already has its one-line explanation."""


class DoesNotFit(TrainingFailed):
    """The launch guard's refusal: the plan says the swap space, host budget or host memory cannot hold the
    job (status "refused", exit status 3 as for an out-of-memory: nothing was trained or written)."""


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    # Host allocation failures surface as a plain RuntimeError from c10's CPU allocator.
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
