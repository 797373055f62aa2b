"""Write a checkpoint's model as a Hugging Face folder, in bounded memory.

  aidaptiv-ds export CKPT_DIR --out MODEL_DIR [--max-shard-size 5GB] [--model PRESET|HF_DIR] [--merge-lora]
  aidaptiv-ds export CKPT_DIR --format gguf --gguf-type q8_0 --out model.gguf      # for llama.cpp and Ollama

See :mod:`aidaptiv_ds.job.export` for the Hugging Face folder and :mod:`aidaptiv_ds.models.gguf_writer` for GGUF
(written from that folder, made in a temporary folder beside the file and removed afterwards; a LoRA checkpoint
is merged into its base first).
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR|FILE.gguf",
        help="folder for the Hugging Face model (new or empty), or with --format gguf the GGUF file to write",
    )
    p.add_argument(
        "--format",
        choices=("safetensors", "gguf"),
        default="safetensors",
        help="safetensors: a Hugging Face folder (default); gguf: one file for llama.cpp, Ollama and LM Studio "
        "(Llama, Mistral and Qwen2 models, with the tokenizer and chat template)",
    )
    p.add_argument(
        "--gguf-type",
        choices=("bf16", "f16", "q8_0"),
        default="bf16",
        help="with --format gguf: the weights' type (default bf16; q8_0 is about half the size, 8-bit blocks)",
    )
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
    if args.format == "gguf":
        return _to_gguf(args)
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


def _to_gguf(args) -> int:
    """The checkpoint as a Hugging Face folder (merged when it holds LoRA adapters), then that folder as GGUF."""
    import shutil

    from aidaptiv_ds.models.gguf_writer import write

    def say(m: str) -> None:
        print(f"aidaptiv-ds export: {m}", file=sys.stderr, flush=True)

    if not args.out.endswith(".gguf") or os.path.exists(args.out):
        say(f"--out {args.out}: give a new file name ending in .gguf for --format gguf")
        return 1
    folder = f"{args.out}.hf-{os.getpid()}"
    try:
        from aidaptiv_ds.job.export import Checkpoint, resolve_checkpoint

        lora = Checkpoint(resolve_checkpoint(args.checkpoint)).has_adapters
        export(args.checkpoint, folder, model=args.model, merge_lora=lora, log=say)
        s = write(folder, args.out, args.gguf_type, log=say)
    except (ExportError, ValueError, OSError) as e:
        say(as_flags(str(e)))
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"aidaptiv-ds export: {s['tensors']} tensors of {args.checkpoint} -> {s['file']} ({s['type']}, "
        f"{s['bytes']:,} bytes, {s['architecture']}, pre-tokenizer {s['pre_tokenizer']})"
    )
    return 0
