"""Write a checkpoint's model as a Hugging Face folder, in bounded memory.

  aidaptiv-ds export CKPT_DIR --out MODEL_DIR [--max-shard-size 5GB] [--model PRESET|HF_DIR] [--merge-lora]

See :mod:`aidaptiv_ds.job.export` for what is written and how.
"""

from __future__ import annotations

import argparse
import sys

from aidaptiv_ds.commands.flags import as_flags
from aidaptiv_ds.job.export import ADAPTER_DIR, DEFAULT_SHARD, ExportError, export
from aidaptiv_ds.swap.checkpoint_format import MODEL_FILES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a --save-dir of an aidaptiv run (its latest tag) or one tag folder in it",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the Hugging Face model (new or empty)")
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_SHARD,
        metavar="SIZE",
        help=f"largest safetensors shard ('5GB', '500MiB', bytes); default {DEFAULT_SHARD}",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="PRESET|HF_DIR",
        help="the model the checkpoint trained, for config and tokenizer files when the checkpoint has "
        f"no {MODEL_FILES}/ folder (default: the checkpoint's own)",
    )
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="checkpoints of 'train --lora': write the base weights with the adapters merged in "
        "(W + alpha/r * B @ A) instead of the frozen base; either way the adapter is also written "
        f"in PEFT's format to DIR/{ADAPTER_DIR}",
    )


def run(args: argparse.Namespace) -> int:
    try:
        s = export(
            args.checkpoint,
            args.out,
            args.max_shard_size,
            model=args.model,
            merge_lora=args.merge_lora,
            log=lambda m: print(f"aidaptiv-ds export: {m}", file=sys.stderr, flush=True),
        )
    except (ExportError, ValueError, OSError) as e:
        print(f"aidaptiv-ds export: {as_flags(str(e))}", file=sys.stderr)
        return 1
    print(
        f"aidaptiv-ds export: {s['tensors']} tensors ({s['bytes']:,} bytes, {s['dtype']}, from {s['world_size']} "
        f"ranks) of {s['checkpoint']} -> {s['out']}: {', '.join(s['files'])}"
    )
    return 0
