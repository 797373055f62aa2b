"""Fine-tune a causal LM with DeepSpeed ZeRO-3 (and, with an "aidaptiv" block in the config, our NVMe swapper).

  aidaptiv-ds train --config ds_configs/zero3.json --model tiny --steps 10 --metrics-out run.json
  deepspeed --num_accelerators 2 --module aidaptiv_ds train --config ds_configs/zero_infinity.json ...

The flags become :class:`aidaptiv_ds.job.settings.TrainSettings`; the run is :class:`aidaptiv_ds.job.train.Run`
(prepare, build, train, close). This module turns its outcome into the metrics file, one status line and an exit
status: 0 ok, 1 error, 3 out of memory (GPU or host) or refused before launch because the plan says the job
cannot fit (status "refused").
"""

from __future__ import annotations

__all__ = ["add_arguments", "run", "HELP_EPILOG"]

import argparse
import sys
import traceback
import warnings

from aidaptiv_ds.commands import flags
from aidaptiv_ds.job import settings as S
from aidaptiv_ds.job.failures import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_OOM,
    DoesNotFit,
    TrainingFailed,
    explain_peer_failure,
    is_oom,
    last_line,
)

HELP_EPILOG = (
    "exit status: 0 ok, 1 error, 3 out of memory (GPU or host) or refused before launch because the plan\n"
    'says the job cannot fit; the --metrics-out file says which ("status") either way.'
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The train job's flags, in the groups ``--help`` shows them in."""
    from aidaptiv_ds.job.lr_schedule import SCHEDULES
    from aidaptiv_ds.models.presets import preset_names

    data = p.add_argument_group("model and data")
    schedule = p.add_argument_group("schedule", "how long, how much per step, how fast the weights move")
    memory = p.add_argument_group("memory and swap")
    ranks = p.add_argument_group("several ranks")
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
        default=S.DEFAULT_MODEL,
        metavar="PRESET|HF_DIR",
        help=f"a preset ({', '.join(preset_names())}) with random weights, or a local Hugging Face "
        f"model directory (config, weights and tokenizer read from disk). Default: {S.DEFAULT_MODEL}",
    )
    data.add_argument(
        "--data",
        default=None,
        metavar="FILE|DIR",
        help='records (Dolly, Alpaca, prompt/response, chat messages, or {"text"} passages) in a .jsonl, .json, '
        ".csv or .parquet file or a datasets save_to_disk folder; default: the set packaged with "
        "aidaptiv_ds",
    )
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
    data.add_argument(
        "--router-aux-loss-coef",
        type=float,
        default=None,
        metavar="W",
        help="mixtures of experts: the weight of the router's load-balancing loss added to the loss (the "
        "model's own router_aux_loss_coef by default, e.g. 0.001 for Qwen3-MoE; 0: none). The loss and its "
        "per-step auxiliary part go to the metrics (losses, aux_losses)",
    )
    flags.add(
        data,
        flags.SEED,
        default=S.DEFAULT_SEED,
        help=f"seeds weights, data order and RNGs; default {S.DEFAULT_SEED}",
    )
    flags.add(
        data,
        flags.DTYPE,
        auto=True,
        default=None,
        help="override the config's precision (fp16 needs CUDA); auto: the model's own (its config's dtype) where "
        "this machine computes it natively, else fp32. Default: the config's, said at the start with the model's",
    )
    data.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out this fraction of the records (picked from --seed, at least one) for evaluation; "
        "they are never trained on. Default 0: no held-out split (every record trains)",
    )
    data.add_argument(
        "--eval-data",
        default=None,
        metavar="FILE|DIR",
        help="evaluate on this data instead (same forms as --data); not with --eval-fraction",
    )

    schedule.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps to reach (counting resumed ones); default 10, or with --epochs as many as "
        "the epochs take (with both, whichever ends first)",
    )
    schedule.add_argument(
        "--epochs",
        type=float,
        default=None,
        metavar="N",
        help="passes over the training data (the records not held out; fractions allowed): sets the "
        "number of optimizer steps to ceil(N x training tokens / tokens per step). With --steps "
        "as well, the run stops at whichever comes first. Default: none (--steps decides)",
    )
    schedule.add_argument(
        "--seq-len",
        type=int,
        default=S.DEFAULT_SEQ_LEN,
        help=f"tokens per packed sequence; default {S.DEFAULT_SEQ_LEN}",
    )
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
    schedule.add_argument(
        "--lr-schedule",
        choices=tuple(SCHEDULES),
        default=None,
        help="learning-rate schedule over the run's optimizer steps, from the optimizer's lr (the "
        "config's or --lr): constant, linear or cosine decay to 0, each after --warmup-steps; "
        "replaces the config's scheduler section. Default: the config's scheduler, if any",
    )
    schedule.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="K",
        help="optimizer steps of linear lr warm-up from 0 for --lr-schedule (not --warmup, which only "
        "leaves steps out of the timing medians); default 0",
    )
    schedule.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="with held-out data, its loss every N optimizer steps as well as after the last one "
        "(0, the default: after the last only). Goes to the metrics (eval_losses) and to the "
        "config's monitors (aidaptiv/eval_loss)",
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
    flags.add(
        memory, flags.NVME_PATH, default=None, help="swap directory: replaces nvme_path wherever the config has one"
    )
    memory.add_argument(
        "--create-nvme-path",
        action="store_true",
        help="make --nvme-path on this node (mode 0700, parents too) when it is missing, and remove it "
        "at exit when empty: for a swap folder named by a launcher on another node, as "
        "'aidaptiv-ds sweep' does for cells that span nodes",
    )
    flags.add(
        memory,
        flags.HOST_BUDGET,
        default=None,
        help="aidaptiv only: host memory for staging and caching ('512MiB', bytes, '25%%' of RAM, "
        "'64GiB/node'); overrides the config's aidaptiv.host_memory_budget",
    )
    memory.add_argument(
        "--keep-swap",
        action="store_true",
        help="keep DeepSpeed's NVMe swap files after the run (default: each rank removes its own; "
        "checkpoints carry their own copy)",
    )
    flags.add(memory, flags.GPU_MEM_CAP_GB, default=None, help="cap this process's CUDA memory")
    memory.add_argument(
        "--no-fit-check",
        action="store_true",
        help="start even when the plan says the swap space, host budget or host memory cannot hold the "
        "job (the problems are printed as a warning): to measure where it really runs out, as "
        "bench/capacity_seq_len.py does",
    )

    ranks.add_argument(
        "--peer-timeout",
        type=float,
        default=S.DEFAULT_PEER_TIMEOUT_S,
        metavar="SECONDS",
        help="how long a rank waits in a collective for the other ranks before it fails, saying so: a node lost "
        "or a link cut ends the job after this (default %(default)g s; raise it when one rank's save or export "
        "takes longer than that while the others wait)",
    )

    ranks.add_argument(
        "--time-collectives",
        action="store_true",
        help="time how long rank 0 waits on each kind of collective (all-gather, reduce-scatter, all-reduce) per "
        "step, in the call and on its handle: the metrics' collectives_s (median seconds and calls per timed step)",
    )

    checkpoints.add_argument("--save-dir", default=None, help="write DeepSpeed checkpoints here (tag stepN)")
    checkpoints.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save every N optimizer steps (0: only at the end, when --save-dir is given)",
    )
    checkpoints.add_argument(
        "--keep-last",
        type=int,
        default=0,
        metavar="N",
        help="keep only the newest N checkpoints in --save-dir, removing older ones once a newer one is complete "
        "(0, the default: keep all)",
    )
    checkpoints.add_argument(
        "--resume",
        choices=("auto",),
        default=None,
        help="auto: resume from the latest checkpoint in --save-dir, or start fresh (saying so) when "
        "there is none; for a given checkpoint use --resume-from",
    )
    checkpoints.add_argument(
        "--resume-from",
        default=None,
        metavar="DIR",
        help="a --save-dir (resumes its latest tag) or one tag directory in it (see also --resume auto)",
    )

    output.add_argument(
        "--warmup",
        type=int,
        default=S.DEFAULT_TIMING_WARMUP,
        help="first steps left out of medians and NVMe byte counts (timing only; the learning-rate "
        f"warm-up is --warmup-steps); default {S.DEFAULT_TIMING_WARMUP} (at least one step is always timed)",
    )
    flags.add(output, flags.METRICS_OUT, default=None, help="write the run's metrics here (rank 0)")
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
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    output.add_argument("-v", "--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    # The deepspeed launcher passes --local_rank=N (we read LOCAL_RANK from the environment instead).
    p.add_argument("--local_rank", "--local-rank", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _write_metrics(job, metrics: dict, failed: bool) -> None:
    from aidaptiv_ds.common.metrics import write_json

    path = job.settings.metrics_out
    if not path:
        return
    if job.rank == 0:
        write_json(path, metrics)
    elif failed:
        # Rank 0 may be stuck in a collective waiting for us: leave the reason where the caller looks,
        # unless rank 0 has written it already.
        write_json(path, metrics, exclusive=True)


def _setting_names() -> set:
    from dataclasses import fields

    return {f.name for f in fields(S.TrainSettings)}


def run(args) -> int:
    from aidaptiv_ds.job.rank_env import end_rank_process, ensure_single_process_env

    ensure_single_process_env()
    # DeepSpeed 0.19.8 calls collectives that torch 2.13 deprecates, once per step; say nothing about them.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    from aidaptiv_ds.common.metrics import one_line
    from aidaptiv_ds.job.train import Run

    settings = args if isinstance(args, S.TrainSettings) else S.TrainSettings.from_namespace(args)
    names = _setting_names()
    job = Run(
        settings, say=lambda m: print(f"aidaptiv-ds train: {flags.as_flags(m, names)}", file=sys.stderr, flush=True)
    )
    status, error, metrics, where = "ok", None, None, None
    try:
        job.prepare()
        job.build()
        metrics = job.train()
    except KeyboardInterrupt:
        status, error = "stopped", "stopped by the user (Ctrl-C or SIGINT)"
    except BaseException as exc:  # noqa: BLE001 - every failure must end in one clear line and a status
        if isinstance(exc, SystemExit):
            raise
        peer_failure = explain_peer_failure(
            last_line(exc), getattr(job, "peers", None), job.rank, settings.peer_timeout
        )
        # A lost or silent peer is said in one line: its traceback is DeepSpeed's wait, not the cause.
        known = isinstance(exc, (TrainingFailed, ValueError, OSError)) or peer_failure != last_line(exc)
        try:
            oom = is_oom(exc)
        except ImportError:
            oom = isinstance(exc, MemoryError)
        if (not known and not oom) or settings.verbose:
            traceback.print_exc(file=sys.stderr)
        status = "oom" if oom else "refused" if isinstance(exc, DoesNotFit) else "error"
        if status == "error":
            # A known error's one line says what to do; where it came from goes to the metrics, so a failure on a
            # machine one can no longer reach (a sweep cell, a lent GPU) can still be traced.
            where = flags.as_flags(traceback.format_exc(limit=-12), _setting_names())
        # A config's problems are all said at once (ConfigError lists them); other errors by their last line.
        listed = getattr(exc, "problems", None)
        if isinstance(listed, list) and len(listed) > 1:
            error = f"{type(exc).__name__}: " + str(exc).strip()
        else:
            error = str(exc) if isinstance(exc, TrainingFailed) else peer_failure
        error = flags.as_flags(error, names)
    finally:
        job.close()
    if status != "ok":
        metrics = {
            "status": status,
            "error": error,
            **job.info,
            "steps": getattr(job, "steps", settings.steps),
            # what ran before the failure (a save or export that fails at the end keeps the run's curve)
            "losses": getattr(job, "losses", None) or None,
            "eval_losses": getattr(job, "eval_losses", None) or None,
            "tokens_per_s": None,
            "step_s_median": None,
        }
        if where:
            metrics["traceback"] = where
    else:  # what close() did with the swap files
        metrics.update({k: job.info[k] for k in ("swap_kept", "swap_removed") if k in job.info})
    try:
        _write_metrics(job, metrics, failed=status != "ok")
    except OSError as e:  # a full disk (often the failure itself): say so and keep where the error came from
        print(f"aidaptiv-ds train: cannot write --metrics-out {settings.metrics_out}: {e}", file=sys.stderr, flush=True)
        if where:
            print(where, file=sys.stderr, flush=True)
    if job.rank == 0 or status != "ok":
        print(one_line(metrics) if job.rank == 0 else f"rank {job.rank}: {one_line(metrics)}", flush=True)
    code = {"ok": EXIT_OK, "oom": EXIT_OOM, "refused": EXIT_OOM}.get(status, EXIT_ERROR)
    if job.world_size > 1:
        end_rank_process(code)  # gloo's threads must not meet the interpreter's teardown (see end_rank_process)
    return code
