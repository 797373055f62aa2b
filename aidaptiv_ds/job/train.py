"""Fine-tune a causal LM with DeepSpeed ZeRO-3 (and, with an "aidaptiv" block in the config, our NVMe swapper).

  aidaptiv-ds train --config ds_configs/zero3.json --model tiny --steps 10 --metrics-out run.json
  deepspeed --num_accelerators 2 --module aidaptiv_ds train --config ds_configs/zero_infinity.json ...

The model is a preset shape with random weights (micro, tiny, llama2-7b, ..., see --model) or a local Hugging
Face directory; the data is a file or folder of instruction records (JSONL, JSON, CSV, Parquet or a datasets
save_to_disk folder; the packaged set by default), rendered through the tokenizer's chat template when it has
one, packed into sequences of exactly --seq-len tokens. The run makes --steps optimizer steps or --epochs passes
over the data, can hold records out and report their loss (--eval-fraction/--eval-data, --eval-every), follow
a learning-rate schedule with warm-up (--lr-schedule, --warmup-steps), save every N steps and pick up where it
stopped (--save-every, --resume auto). Every step is timed by phase; --metrics-out writes one JSON object with tokens/s,
the median step time after --warmup steps, the loss trajectory (mean over ranks), peak host/GPU memory and
the NVMe bytes the ranks read and wrote. Exit status: 0 ok, 1 error, 3 out of memory (GPU or host) or refused
before launch because the plan says the job cannot fit (status "refused"); the metrics file says which
("status") either way. With an "aidaptiv" block, --output-dir writes the trained model
in Hugging Face format (see aidaptiv_ds.job.export); with DeepSpeed's "csv_monitor", "tensorboard" or "wandb"
sections, every step's loss, lr, tokens/s, step split, NVMe GB/s, host budget, pinned and GPU memory go to
them (aidaptiv_ds.common.metrics.MONITOR_SERIES); W&B runs offline into the --metrics-out folder unless WANDB_MODE /
WANDB_DIR say otherwise (aidaptiv_ds.job.wandb_env).

Run directly it is a 1-process job (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are set when absent); under the
deepspeed launcher or torchrun it is one rank of many (gloo on CPU, nccl on CUDA); started by srun (by hand or
DeepSpeed's --launcher slurm), it takes its rank, world size and rendezvous from SLURM's variables
(aidaptiv_ds.job.rank_env).
"""

from __future__ import annotations

__all__ = ["Run", "add_arguments", "run"]

import contextlib
import copy
import logging
import os
import random
import shutil
import sys
import time
import traceback
import warnings

# add_arguments is this subcommand's parser (aidaptiv_ds.cli calls train.add_arguments and train.run).
from aidaptiv_ds.job.args import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_OOM,
    DoesNotFit,
    TrainingFailed,
    _is_oom,
    _last_line,
    add_arguments,
)
from aidaptiv_ds.job.checkpoints import _resolve_resume, _rng_state, _set_rng_state
from aidaptiv_ds.job.rank_env import ensure_single_process_env, make_nvme_path

HELP_EPILOG = (
    "exit status: 0 ok, 1 error, 3 out of memory (GPU or host) or refused before launch because the plan\n"
    'says the job cannot fit; the --metrics-out file says which ("status") either way.'
)


def _aidaptiv_api():
    """aidaptiv_ds.initialize (and zero_init if present), or a clear failure if this build lacks them."""
    import aidaptiv_ds

    init = getattr(aidaptiv_ds, "initialize", None)
    if init is None:
        raise TrainingFailed(
            'the config has an "aidaptiv" block but this aidaptiv_ds has no initialize(): '
            "remove the block to run plain DeepSpeed, or install a build with the swapper"
        )
    return init, getattr(aidaptiv_ds, "zero_init", None)


class Run:
    """One training run; fields filled as it goes so a failure can still report what is known."""

    def __init__(self, args):
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.info: dict = {}
        self.engine = None

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def print_activation_plan(self, engine) -> None:
        """The auto activation policy's plan, made during the first forward: printed once (it is also in the
        metrics under activations.plan)."""
        stats = engine.aidaptiv_stats() if callable(getattr(engine, "aidaptiv_stats", None)) else None
        plan = ((stats or {}).get("activations") or {}).get("plan")
        if plan:
            from aidaptiv_ds.activations.plan import render

            self.log(f"aidaptiv-ds train: {render(plan)}")

    def prepare(self):
        """Config, model spec, data: everything that can fail cheaply, before DeepSpeed starts."""
        from aidaptiv_ds.config import ds_config
        from aidaptiv_ds.job import train_plan
        from aidaptiv_ds.models import presets as models
        from aidaptiv_ds.models.tokenizer import tokenizer_for

        a = self.args
        if a.seq_len < 1:
            raise ValueError(f"--seq-len {a.seq_len} must be at least 1")
        if a.save_every < 0 or a.warmup < 0:
            raise ValueError("--save-every and --warmup must not be negative")
        found = train_plan.problems(a)
        if getattr(a, "create_nvme_path", False) and not a.nvme_path:
            found.append("--create-nvme-path needs --nvme-path: give the swap folder to make on this node")
        if found:
            raise TrainingFailed("; ".join(found))
        if getattr(a, "create_nvme_path", False):  # before the config check, which refuses a missing folder
            self.info["nvme_path_created"] = make_nvme_path(os.path.abspath(a.nvme_path))
        self.lora = None
        if getattr(a, "lora", None):
            from aidaptiv_ds.job.lora import parse_spec

            self.lora = parse_spec(a.lora)
        cfg = ds_config.load(a.config, what="--config")
        cfg = ds_config.apply_overrides(
            cfg,
            micro_batch=a.micro_batch,
            grad_accum=a.grad_accum,
            lr=a.lr,
            nvme_path=os.path.abspath(a.nvme_path) if a.nvme_path else None,
            dtype=a.dtype,
            host_budget=a.host_budget,
        )
        if getattr(a, "gradient_checkpointing", False):
            cfg = self.checkpointing_in_block(cfg)
        else:
            cfg = self.auto_activations_by_default(cfg)
        for block in ds_config.nvme_blocks(cfg):  # relative paths mean the working directory, as in DeepSpeed;
            if block["nvme_path"]:  # made absolute so that logs and metrics are unambiguous
                block["nvme_path"] = os.path.abspath(block["nvme_path"])
        self.spec = models.resolve(a.model)
        import torch

        self.cuda = torch.cuda.is_available()
        ds_config.check(
            cfg,
            world_size=self.world_size,
            largest_param_numel=self.spec.largest_parameter_numel,
            model_name=self.spec.name,
            cuda=self.cuda,
        )
        self.cfg = cfg
        self.backend = ds_config.backend(cfg)
        self.note_wandb(cfg)
        self.check_fits(cfg, a.seq_len)
        if getattr(a, "output_dir", None) and self.backend != "aidaptiv":
            raise TrainingFailed(
                f'--output-dir needs a config with an enabled "aidaptiv" block (this one runs '
                f"{self.backend}): the export reads the checkpoint our swapper writes; for plain "
                "DeepSpeed save with --save-dir and convert with DeepSpeed's zero_to_fp32.py"
            )
        if getattr(a, "output_dir", None):
            from aidaptiv_ds.job.export import out_problem

            problem = out_problem(a.output_dir)
            if problem:
                raise TrainingFailed(f"--output-dir: {problem}")
        self.dtype = ds_config.torch_dtype(cfg)
        self.micro_batch = int(
            cfg.get("train_micro_batch_size_per_gpu")
            or cfg["train_batch_size"] // (self.world_size * cfg.get("gradient_accumulation_steps", 1))
        )
        self.grad_accum = int(cfg.get("gradient_accumulation_steps", 1))
        self.tokenizer = tokenizer_for(self.spec)
        if self.tokenizer.vocab_size > self.spec.config.vocab_size:
            raise TrainingFailed(
                f"the tokenizer of {a.model} has {self.tokenizer.vocab_size} ids but the model's "
                f"vocabulary is {self.spec.config.vocab_size}: use the model's own tokenizer files"
            )
        data_path = self.prepare_data(cfg)
        self.info.update(
            model=self.spec.name,
            params=self.spec.num_parameters,
            backend=self.backend,
            dtype=ds_config.dtype_name(cfg),
            micro_batch=self.micro_batch,
            seq_len=a.seq_len,
            grad_accum=self.grad_accum,
            world_size=self.world_size,
            config=a.config,
            data=data_path,
            tokenizer=self.tokenizer.name,
            seed=a.seed,
            lr=((cfg.get("optimizer") or {}).get("params") or {}).get("lr"),
            nvme_paths=sorted({b["nvme_path"] for b in ds_config.nvme_blocks(cfg)}) or None,
            device="cuda" if self.cuda else "cpu",
        )

    @staticmethod
    def auto_activations_by_default(cfg: dict) -> dict:
        """A block that names no activations policy runs this job with policy "auto": the job's models all have
        the block list auto plans over, so a long sequence trains within the memory the process may use (its
        cgroup's limit included) without the user naming a policy, and a short one keeps everything as "keep"
        would. The block's own default stays "keep" for other programs (a plain script's model may have no
        block list), and the shipped configs do not write "auto": the Hugging Face Trainer and accelerate take
        any "auto" string in a DeepSpeed config for one of theirs to fill, and refuse it."""
        block = cfg.get("aidaptiv")
        if not isinstance(block, dict) or not block.get("enabled"):
            return cfg
        activations = block.get("activations")
        if activations is None:
            activations = {}
        if not isinstance(activations, dict) or "policy" in activations:
            return cfg
        cfg = copy.deepcopy(cfg)
        cfg["aidaptiv"]["activations"] = {**activations, "policy": "auto"}
        return cfg

    def checkpointing_in_block(self, cfg: dict) -> dict:
        """--gradient-checkpointing with an "aidaptiv" block: the block's activation policy does the
        checkpointing (one mechanism, and "nvme" stores what it keeps), so the flag becomes policy "recompute"
        where the block names none; "recompute" and "nvme" already checkpoint; an explicit "keep" contradicts
        the flag. An explicit "auto" becomes "recompute" too (the flag is the more specific wish). Without the
        block the flag is applied to the model in build()."""
        block = cfg.get("aidaptiv")
        if not isinstance(block, dict) or not block.get("enabled"):
            return cfg
        activations = block.get("activations") or {}
        policy = activations.get("policy") if isinstance(activations, dict) else None
        if policy == "keep":
            raise TrainingFailed(
                "--gradient-checkpointing asks to recompute activations but the config's "
                'aidaptiv.activations.policy is "keep": drop the flag, or set the policy to '
                '"recompute" (or "nvme", which also stores the checkpoints on NVMe)'
            )
        if policy in (None, "auto") and isinstance(activations, dict):
            cfg = copy.deepcopy(cfg)
            cfg["aidaptiv"]["activations"] = {**activations, "policy": "recompute"}
            policy = "recompute"
        self.info["gradient_checkpointing"] = f"aidaptiv.activations.policy {policy}"
        return cfg

    def prepare_data(self, cfg: dict) -> str:
        """Training stream and held-out batches, the run's step count, and the lr schedule that needs it."""
        from aidaptiv_ds.job import data as D
        from aidaptiv_ds.job import lr_schedule, train_plan

        a = self.args
        data_path = a.data or D.DEFAULT_DATA
        train_records, held_out = D.split_held_out(D.load_records(data_path), a.eval_fraction, a.seed)
        self.batches = D.ShardedBatches(
            D.PackedStream(D.tokenize(train_records, self.tokenizer), a.seq_len, a.seed),
            self.micro_batch,
            self.rank,
            self.world_size,
        )
        if a.eval_data:
            held_out = D.load_records(a.eval_data)
        self.eval_batches = None
        if held_out:
            what = f"--eval-data {a.eval_data}" if a.eval_data else f"the held-out {a.eval_fraction:g} of {data_path}"
            self.eval_batches = D.EvalBatches(
                D.tokenize(held_out, self.tokenizer), a.seq_len, self.micro_batch, self.rank, self.world_size, what=what
            )
        epoch_tokens = self.batches.stream.epoch_tokens
        tokens_per_step = self.micro_batch * a.seq_len * self.grad_accum * self.world_size
        self.steps = train_plan.total_steps(a.steps, a.epochs, epoch_tokens, tokens_per_step)
        found = lr_schedule.problems(a.lr_schedule, a.warmup_steps, self.steps)
        if found:
            raise TrainingFailed("; ".join(found))
        self.lr_scheduler = None
        if a.lr_schedule:
            if cfg.pop("scheduler", None) is not None:
                self.log(f"aidaptiv-ds train: --lr-schedule {a.lr_schedule} replaces the config's scheduler section")
            self.lr_scheduler = lr_schedule.scheduler_factory(a.lr_schedule, a.warmup_steps, self.steps)
        self.info.update(
            train_records=len(train_records),
            epoch_tokens=epoch_tokens,
            steps_per_epoch=epoch_tokens / tokens_per_step,
            eval_data=a.eval_data or (data_path if held_out else None),
            eval_records=len(held_out) or None,
            eval_sequences=self.eval_batches.sequences if self.eval_batches else None,
            lr_schedule=a.lr_schedule,
            warmup_steps=a.warmup_steps if a.lr_schedule else None,
            chat_template=bool(getattr(self.tokenizer, "has_chat_template", False)),
        )
        return data_path

    def note_wandb(self, cfg: dict) -> None:
        """With the config's "wandb" section on: W&B offline (unless WANDB_MODE says otherwise), its files in
        the --metrics-out folder (else the working directory) unless WANDB_DIR says otherwise."""
        from aidaptiv_ds.job import wandb_env

        out = self.args.metrics_out
        wandb = wandb_env.prepare(cfg, os.path.dirname(os.path.abspath(out)) if out else os.getcwd())
        if wandb:
            self.info["wandb"] = wandb

    def check_fits(self, cfg: dict, seq_len: int) -> None:
        """Refuse, before a byte is written, a job whose swap space, host budget or host memory cannot hold
        it (the planner's figures for this node's ranks; see aidaptiv_ds.planner.guard). Presets and
        Llama-shaped directories only: another architecture is sized once built, as before."""
        from aidaptiv_ds.config import ds_config
        from aidaptiv_ds.config.host import total_ram_bytes
        from aidaptiv_ds.planner.guard import launch_problems
        from aidaptiv_ds.planner.shapes import LLAMA_LIKE, shape_of_config

        if getattr(self.spec.config, "model_type", None) not in LLAMA_LIKE:
            return
        micro = int(cfg.get("train_micro_batch_size_per_gpu") or 1)
        local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or self.world_size)
        problems = launch_problems(
            shape_of_config(self.spec.name, self.spec.config),
            cfg,
            world_size=self.world_size,
            local_world_size=min(local, self.world_size),
            seq_len=seq_len,
            micro_batch=micro,
            cuda=self.cuda,
            ram_bytes=total_ram_bytes(),
            lora=self.lora is not None,
        )
        if not problems:
            return
        text = str(ds_config.ConfigError(problems, source=f"plan for {self.spec.name}"))
        if getattr(self.args, "no_fit_check", False):
            self.info["fit_check"] = {"skipped": True, "problems": problems}
            print(f"aidaptiv-ds train: warning: --no-fit-check: starting although {text}", file=sys.stderr, flush=True)
            return
        raise DoesNotFit(text)  # every problem, in full (a ConfigError would be cut to its last line by run())

    def build(self):
        import deepspeed
        import torch

        a = self.args
        if not a.verbose:
            from aidaptiv_ds.zero3.compat import set_deepspeed_log_level

            set_deepspeed_log_level(logging.WARNING)
        random.seed(a.seed)
        torch.manual_seed(a.seed)
        deepspeed.init_distributed()
        # DeepSpeed's CPU communicator leaves a 66 MiB /dev/shm segment per rank behind (see dist_shm).
        from aidaptiv_ds.zero3 import dist_shm

        dist_shm.release_after_barrier()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if a.gpu_mem_cap_gb:
                total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, a.gpu_mem_cap_gb * 2**30 / total))
        self.info.update(deepspeed_version=deepspeed.__version__, torch_version=torch.__version__)

        from aidaptiv_ds.models.presets import build_model

        stage3 = int((self.cfg.get("zero_optimization") or {}).get("stage", 0)) == 3
        initialize = deepspeed.initialize
        init_context = None
        if self.backend == "aidaptiv":
            initialize, zero_init = _aidaptiv_api()
            init_context = zero_init(self.cfg) if zero_init else deepspeed.zero.Init(config_dict_or_path=self.cfg)
        elif stage3:
            # No dtype argument: Init takes it from the config (DeepSpeed 0.19.8's _set_dtype turns an explicit
            # dtype=torch.float32 into bf16 on a CPU without fp16, an operator-precedence bug).
            init_context = deepspeed.zero.Init(config_dict_or_path=self.cfg)
        t0 = time.perf_counter()
        qlora = self.lora is not None and self.lora.bits == 4
        # QLoRA quantises a built base, so it is built whole (not partitioned while built); initialize then
        # partitions the 4-bit model into the swap space like any model built outside zero.Init.
        model = build_model(self.spec, self.dtype, None if qlora else init_context, self.cfg)
        if qlora:
            from aidaptiv_ds.job import lora

            self.info["qlora_layers"] = lora.quantize_base(model, self.dtype or torch.float32)
        if getattr(a, "gradient_checkpointing", False) and self.backend != "aidaptiv":
            self.enable_gradient_checkpointing(model)
        if self.lora is not None:
            model = self.add_adapters(model)
        self.info["build_s"] = time.perf_counter() - t0
        params = [p for p in model.parameters() if p.requires_grad]
        t0 = time.perf_counter()
        self.engine, _, _, _ = initialize(
            model=model, model_parameters=params, config=self.cfg, lr_scheduler=self.lr_scheduler
        )
        self.info["initialize_s"] = time.perf_counter() - t0
        self.check_saveable()
        self.note_io_settings()
        self.check_partition_dtype(model)
        self.note_loss_chunking(model)

    def check_saveable(self) -> None:
        """A run that will save (--save-dir, --output-dir) learns before its first step whether its swapped
        state can be saved, instead of losing every step to a refusal at its first checkpoint."""
        a = self.args
        ask = getattr(self.engine, "aidaptiv_save_problem", None)
        if not (a.save_dir or getattr(a, "output_dir", None)) or not callable(ask):
            return
        problem = ask()
        if problem:
            raise TrainingFailed(f"refused before the first step: {problem}")

    def enable_gradient_checkpointing(self, model) -> None:
        """--gradient-checkpointing for the stock backends: what their users turn on, the Hugging Face model's
        gradient_checkpointing_enable(use_reentrant=False) (the HF Trainer's gradient_checkpointing=True), called
        on the built (under ZeRO-3 partitioned) model before deepspeed.initialize, as the Trainer does.
        DeepSpeed's "activation_checkpointing" section is not it: that section only configures
        deepspeed.checkpointing.checkpoint, which a model must call itself (Megatron-style code) and Hugging Face
        models never do; its partition_activations / cpu_checkpointing need model parallelism."""
        from aidaptiv_ds.activations.policy import enable_recompute

        self.info["gradient_checkpointing"] = enable_recompute(model)
        self.log(f"aidaptiv-ds train: gradient checkpointing: {self.info['gradient_checkpointing']}")

    def add_adapters(self, model):
        """--lora: PEFT's adapters on the built (and, under ZeRO-3, partitioned) base, which is frozen."""
        from aidaptiv_ds.job import lora

        model = lora.apply(model, self.lora)
        if self.dtype is not None:  # adapters are made in fp32; train them in the base's dtype
            for p in model.parameters():
                if p.requires_grad and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
        self.info["lora"] = {"spec": self.lora.describe(), "trainable_params": lora.trainable_numel(model)}
        self.log(
            f"aidaptiv-ds train: {self.lora.describe()}: {self.info['lora']['trainable_params']:,} trainable parameters"
        )
        return model

    def note_io_settings(self) -> None:
        """Log, and keep for the metrics, the swapper's block size and queue depth and where each came from
        ("config", "tuned" for the disk by 'aidaptiv-ds plan --nvme', or "default")."""
        if self.backend != "aidaptiv":
            return
        from aidaptiv_ds.config import resolve as C

        settings = C.resolve(self.cfg)[1]  # the settings the swapper got (resolved once per config)
        if settings is None:
            return
        self.info["aidaptiv_io"] = {
            "block_size": settings.block_size,
            "block_size_source": settings.block_size_source,
            "queue_depth": settings.queue_depth,
            "queue_depth_source": settings.queue_depth_source,
        }
        self.log(
            f"aidaptiv I/O: block_size {settings.block_size // 1024} KiB ({settings.block_size_source}), "
            f"queue_depth {settings.queue_depth} ({settings.queue_depth_source})"
        )

    def check_partition_dtype(self, model) -> None:
        """Every backend trains in the dtype the config asks for, or the job stops here saying why: DeepSpeed
        0.19.8's zero.Init drops an explicit dtype on CPUs it believes lack fp16 (the start-up hook mends that,
        but not with AIDAPTIV_DS_AUTOLOAD=0) and would partition an fp32 model in bf16."""
        # The parameter's own dtype is what the forward computes in (a partition swapped out to NVMe by
        # ZeRO-Infinity is a placeholder of another dtype, so partitions are not looked at).
        found = {str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()}
        wanted = str(self.dtype).replace("torch.", "")
        if found - {wanted}:
            raise TrainingFailed(
                f"the config asks for {wanted} but DeepSpeed partitioned parameters in {', '.join(sorted(found))} "
                "(DeepSpeed 0.19.8's zero.Init ignores an explicit dtype on CPUs without fp16 support): keep the "
                "aidaptiv-ds start-up hook on (unset AIDAPTIV_DS_AUTOLOAD), which mends it"
            )

    def note_loss_chunking(self, model) -> None:
        """What the chunked loss (aidaptiv.activations.loss_chunk_tokens) saves, for the metrics."""
        from aidaptiv_ds.activations import chunked_loss

        chunk = chunked_loss.installed_chunk(model)
        if chunk is None:
            return
        tokens, vocab = self.micro_batch * self.args.seq_len, self.spec.config.vocab_size
        self.info["loss_chunk_tokens"] = chunk
        self.info["loss_logits_mb"] = {
            "unchunked": chunked_loss.logits_bytes(tokens, vocab, None) / 2**20,
            "chunked": chunked_loss.logits_bytes(tokens, vocab, chunk) / 2**20,
        }

    def resume(self) -> dict:
        """Restore from --resume-from or --resume auto; returns the client state (or a fresh one). --resume auto
        takes the newest checkpoint that verifies, saying which tags it skipped and why."""
        from aidaptiv_ds.job.train_plan import checkpoint_candidates
        from aidaptiv_ds.zero3.checkpoint_verify import CheckpointDamagedError

        a = self.args
        fresh = {"step": 0, "data_position": 0, "losses": [], "lrs": []}
        if a.resume == "auto":
            candidates = checkpoint_candidates(a.save_dir)
            if not candidates:
                self.log(f"aidaptiv-ds train: --resume auto: no checkpoint in {a.save_dir} yet, starting from step 0")
                return fresh
            self.log(f"aidaptiv-ds train: --resume auto: the latest checkpoint in {a.save_dir} is {candidates[0]}")
        elif a.resume_from:
            candidates = [a.resume_from]
        else:
            return fresh
        skipped = []
        for source in candidates:
            try:
                load_dir, tag = _resolve_resume(source)
                path, client = self.engine.load_checkpoint(
                    load_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
                )
            except (CheckpointDamagedError, TrainingFailed) as e:  # damaged or planted: with auto, the next tag
                if a.resume != "auto":
                    raise
                skipped.append(source)
                self.log(f"aidaptiv-ds train: --resume auto: skipped {source}: {e}")
                continue
            break
        else:
            raise TrainingFailed(
                f"--resume auto: no checkpoint in {a.save_dir} verifies ({len(skipped)} skipped, each said why "
                "above): start without --resume, or restore a good checkpoint"
            )
        if skipped:
            self.info["resume_skipped"] = skipped
        if path is None or client is None or "step" not in client:
            raise TrainingFailed(f"--resume-from {source}: DeepSpeed found no loadable checkpoint there")
        was = {k: client.get(k) for k in ("seq_len", "micro_batch", "world_size")}
        now = {"seq_len": a.seq_len, "micro_batch": self.micro_batch, "world_size": self.world_size}
        if any(was[k] is not None and was[k] != now[k] for k in now):
            # The data position counts micro-batches of this shape: with another shape the data continues from
            # a different point of the stream than the interrupted run would have.
            self.log(
                f"aidaptiv-ds train: warning: checkpoint was made with {was}, resuming with {now}; "
                "the data order will differ from an uninterrupted run"
            )
        if "rng" in client:
            _set_rng_state(client["rng"])
        self.info["resumed_from"] = path
        self.log(f"aidaptiv-ds train: resumed {path} at step {client['step']}")
        return client

    def remove_deepspeed_swap(self) -> None:
        """ZeRO-Infinity leaves every weight and optimizer moment in its swap files after the run. Remove this
        rank's (they are useless once the engine is gone; checkpoints hold their own copy) unless --keep-swap,
        and say which. Our own swapper (backend aidaptiv) cleans up after itself."""
        if getattr(self, "backend", None) != "zero_infinity":
            return
        from aidaptiv_ds.zero3.compat import zero_infinity_swap_dirs

        dirs = [d for p in self.info.get("nvme_paths") or [] for d in zero_infinity_swap_dirs(p, self.rank)]
        if not dirs:
            return
        if self.args.keep_swap:
            self.info["swap_kept"] = dirs
            self.log(f"aidaptiv-ds train: kept DeepSpeed swap files in {', '.join(dirs)}")
            return
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
            with contextlib.suppress(OSError):  # the kind folder, once every rank has emptied it
                os.rmdir(os.path.dirname(d))
        self.info["swap_removed"] = dirs
        self.log(f"aidaptiv-ds train: removed DeepSpeed swap files in {', '.join(dirs)}")

    def save(self, step: int, position: int, losses: list, save_dir: str | None = None) -> str:
        save_dir = save_dir or self.args.save_dir
        tag = f"step{step}"
        client = {
            "step": step,
            "data_position": position,
            "losses": list(losses),
            "rng": _rng_state(),
            "lrs": list(getattr(self, "lrs", [])),
            "eval_losses": list(getattr(self, "eval_losses", [])),
            "seed": self.args.seed,
            "seq_len": self.args.seq_len,
            "micro_batch": self.micro_batch,
            "world_size": self.world_size,
        }
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client)
        folder = os.path.join(save_dir, tag)
        if self.rank == 0 and self.backend == "aidaptiv":
            # config and tokenizer beside the weights, so that 'aidaptiv-ds export' needs nothing else
            from aidaptiv_ds.job.model_files import MODEL_FILES, save_model_files

            save_model_files(
                self.spec,
                self.tokenizer,
                os.path.join(folder, MODEL_FILES),
                dtype=str(self.dtype).replace("torch.", ""),
            )
            if self.lora is not None:  # how to read the lora_ parameters (export merges or copies them)
                from aidaptiv_ds.job.lora import save_adapter_config, save_qlora_marker

                save_adapter_config(self.engine.module, os.path.join(folder, MODEL_FILES))
                if self.lora.bits == 4:
                    save_qlora_marker(os.path.join(folder, MODEL_FILES))
        if save_dir == self.args.save_dir:
            self.info.setdefault("saved", []).append(folder)
        return folder

    def write_output(self, step: int, position: int, losses: list) -> None:
        """--output-dir: the model in Hugging Face format, written by rank 0 from the final checkpoint (the
        --save-dir one, or one made in DIR/checkpoint and removed afterwards) through the bounded exporter."""
        import torch.distributed as dist

        from aidaptiv_ds.job.export import export

        out = self.args.output_dir
        final = os.path.join(self.args.save_dir, f"step{step}") if self.args.save_dir else None
        temporary = final is None or not os.path.isdir(final)
        if temporary:
            final = self.save(step, position, losses, save_dir=os.path.join(out, "checkpoint"))
        dist.barrier()  # every rank's folder of the checkpoint is written
        failed = None
        if self.rank == 0:
            try:
                summary = export(final, out, merge_lora=self.lora is not None and self.lora.bits != 4, log=self.log)
            except (ValueError, OSError) as e:  # reported after the barrier the other ranks wait at
                failed = e
            else:
                if temporary:
                    shutil.rmtree(os.path.join(out, "checkpoint"), ignore_errors=True)
                self.info["output_dir"] = out
                self.info["output_files"] = summary["files"]
                self.log(f"aidaptiv-ds train: wrote the model in Hugging Face format to {out}")
        dist.barrier()
        if failed is not None:
            raise TrainingFailed(f"--output-dir {out}: the export of {final} failed: {failed}")

    def write_logits(self, path: str) -> None:
        """The trained model's logits on the first data batch (for checking an export against it)."""
        import torch

        batch = {k: v.to(self.engine.device) for k, v in self.batches.batch(0).items()}
        self.engine.eval()
        with torch.no_grad():
            logits = self.engine(input_ids=batch["input_ids"]).logits
        if self.rank == 0:
            torch.save({"input_ids": batch["input_ids"].cpu(), "logits": logits.float().cpu()}, path)

    def monitor(self):
        """DeepSpeed's MonitorMaster when the config enables TensorBoard, CSV or W&B (None otherwise); it
        writes on rank 0 only, so the other ranks skip the per-step readings."""
        m = getattr(self.engine, "monitor", None)
        return m if m is not None and getattr(m, "enabled", False) and self.rank == 0 else None

    def write_monitor(self, monitor, step: int, record: dict, loss: float, tokens_per_step: int, io0) -> None:
        """This step's series (metrics.MONITOR_SERIES) into the config's monitors."""
        import torch

        from aidaptiv_ds.common import metrics as M

        io1 = M.proc_io()
        io = (io1["read_bytes"] - io0["read_bytes"], io1["write_bytes"] - io0["write_bytes"]) if io0 and io1 else None
        lr = None
        with contextlib.suppress(Exception):
            lr = float(self.engine.get_lr()[0])
        stats = self.engine.aidaptiv_stats() if callable(getattr(self.engine, "aidaptiv_stats", None)) else None
        if not hasattr(self, "host_budget"):  # the resolved budget (the config's own object, made once)
            self.host_budget = None
            if self.backend == "aidaptiv":
                from aidaptiv_ds.config import resolve as C

                settings = C.resolve(self.cfg)[1]
                self.host_budget = settings.host_budget_bytes if settings else None
        from aidaptiv_ds.zero3 import monitors

        monitors.write_events(
            monitor,
            M.monitor_events(
                step,
                record,
                loss=loss,
                lr=lr,
                tokens_per_step=tokens_per_step,
                io_bytes=io,
                host_budget=self.host_budget,
                pinned=stats.get("pinned_bytes") if stats else None,
                gpu_mb=torch.cuda.memory_allocated() / 2**20 if self.cuda else None,
                rss_mb=M.rss_mb(),
            ),
            self.engine,
        )

    def current_lr(self) -> float | None:
        """The lr the optimizer's next update uses (its first parameter group's)."""
        with contextlib.suppress(Exception):
            return float(self.engine.get_lr()[0])
        return None

    def run_eval(self, step: int, monitor) -> None:
        """The held-out loss after optimizer step ``step``: into the metrics, the log and the monitors."""
        from aidaptiv_ds.common import metrics as M
        from aidaptiv_ds.job.evaluation import evaluate

        t0 = time.perf_counter()
        loss = evaluate(self.engine, self.eval_batches)
        self.eval_losses.append([step, loss])
        self.log(
            f"aidaptiv-ds train: step {step}: eval loss {loss:.4f} on {self.eval_batches.sequences} held-out "
            f"sequence(s) ({time.perf_counter() - t0:.1f} s)"
        )
        if monitor:
            from aidaptiv_ds.zero3 import monitors

            monitors.write_events(monitor, M.eval_events(step, loss), self.engine)

    def train(self) -> dict:
        import torch
        import torch.distributed as dist

        from aidaptiv_ds.common import metrics as M
        from aidaptiv_ds.job.train_plan import eval_due

        a, engine = self.args, self.engine
        sync = torch.cuda.synchronize if self.cuda else None
        timer = M.StepTimer(sync)
        client = self.resume()
        start, position, losses = int(client["step"]), int(client["data_position"]), list(client["losses"])
        self.losses = losses  # the same list: a failure after some steps still reports them (run())
        # per step, what the run before a resume recorded (None for a checkpoint older than these fields)
        self.lrs = list(client.get("lrs") or [None] * start)
        self.eval_losses = [list(e) for e in client.get("eval_losses") or []]
        steps = self.steps
        steps_to_run = max(0, steps - start)
        warmup = min(a.warmup, max(0, steps_to_run - 1))
        tokens_per_step = self.micro_batch * a.seq_len * self.grad_accum * self.world_size
        device = engine.device
        bar = None
        if self.rank == 0 and not a.no_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=steps,
                initial=start,
                file=sys.stderr,
                desc=f"train {self.spec.name}",
                unit="step",
                dynamic_ncols=True,
            )
        io_start = None
        io_excluded = {"read_bytes": 0, "write_bytes": 0}
        engine.train()
        monitor = self.monitor()
        from aidaptiv_ds.engine.disk import block_device

        swap_devices = [block_device(p)["device"] for p in self.info.get("nvme_paths") or [] if os.path.isdir(p)]
        busy_start, busy_excluded = [], []  # (readings before, after) of evaluations and saves in the window

        def outside_steps(action):
            """Run an evaluation or a save: inside the timed window its disk bytes and busy time are not the
            training steps' (held-out forwards, checkpoint files), so they are taken out of both."""
            before, busy_before = M.proc_io(), [M.disk_busy_ticks(d) for d in swap_devices]
            action()
            after = M.proc_io()
            if before and after and io_start:
                for k in io_excluded:
                    io_excluded[k] += after[k] - before[k]
                busy_excluded.append((busy_before, [M.disk_busy_ticks(d) for d in swap_devices]))

        for i, step in enumerate(range(start, steps)):
            if i == warmup:
                io_start = M.proc_io()
                busy_start = [M.disk_busy_ticks(d) for d in swap_devices]
            step_io = M.proc_io() if monitor else None
            self.lrs.append(self.current_lr())  # what this step's update uses
            timer.start_step()
            micro_losses = []
            for _ in range(self.grad_accum):
                batch = {k: v.to(device) for k, v in self.batches.batch(position).items()}
                position += 1
                t = timer.now()
                loss = engine(**batch).loss
                t1 = timer.now()
                engine.backward(loss)
                t2 = timer.now()
                engine.step()
                t3 = timer.now()
                timer.add("forward", t1 - t)
                timer.add("backward", t2 - t1)
                timer.add("optimizer", t3 - t2)
                micro_losses.append(loss.detach().float())
            step_s = timer.end_step()
            step_loss = torch.stack(micro_losses).mean().to(torch.float64)
            dist.all_reduce(step_loss)
            losses.append(step_loss.item() / self.world_size)
            if i == 0:
                self.print_activation_plan(engine)
            if monitor:
                self.write_monitor(monitor, step + 1, timer.steps[-1], losses[-1], tokens_per_step, step_io)
            if self.eval_batches is not None and eval_due(step + 1, a.eval_every, steps):
                outside_steps(lambda: self.run_eval(step + 1, monitor))
            if a.save_dir and a.save_every and (step + 1) % a.save_every == 0 and step + 1 < steps:
                outside_steps(lambda: self.save(step + 1, position, losses))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_step / step_s:.0f}")
        io_end = M.proc_io()
        busy = None
        if busy_start:
            busy = M.disk_busy(busy_start, [M.disk_busy_ticks(d) for d in swap_devices], busy_excluded)
        if bar is not None:
            bar.close()
        if a.save_dir and steps_to_run > 0:
            self.save(steps, position, losses)
        if getattr(a, "output_dir", None):
            self.write_output(steps, position, losses)
        if getattr(a, "logits_out", None):
            self.write_logits(a.logits_out)

        # Reduce what each rank measured: bytes add up, peaks take the max.
        nvme = [None, None]
        if io_start and io_end:
            nvme = [io_end[k] - io_start[k] - io_excluded[k] for k in ("read_bytes", "write_bytes")]
        t = torch.tensor([float(nvme[0] or 0), float(nvme[1] or 0)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        peak = torch.tensor([M.peak_rss_mb()], dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peak_gpu = None
        if self.cuda:
            g = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], dtype=torch.float64, device=device)
            dist.all_reduce(g, op=dist.ReduceOp.MAX)
            peak_gpu = g.item()
        with contextlib.suppress(Exception):  # what the optimizer will use next (checks a resume's lr)
            self.info["lr_final"] = float(engine.get_lr()[0])
        stats = engine.aidaptiv_stats() if callable(getattr(engine, "aidaptiv_stats", None)) else None
        if stats and stats.get("nvme_read_bytes") is not None:
            self.info["engine_nvme_read_bytes"] = stats.get("nvme_read_bytes")
            self.info["engine_nvme_write_bytes"] = stats.get("nvme_write_bytes")
        return M.summarize(
            step_records=timer.steps,
            warmup=warmup,
            tokens_per_step=tokens_per_step,
            losses=losses,
            engine_stats=stats,
            peak_rss=peak.item(),
            peak_gpu=peak_gpu,
            nvme_read=int(t[0].item()) if nvme[0] is not None else None,
            nvme_write=int(t[1].item()) if nvme[1] is not None else None,
            extra={
                **self.info,
                "steps": steps,
                "first_step": start,
                "warmup": warmup,
                "tokens_per_step": tokens_per_step,
                "lrs": self.lrs,
                "epochs_done": position
                * self.micro_batch
                * self.world_size
                * a.seq_len
                / self.batches.stream.epoch_tokens,
                "eval_losses": self.eval_losses or None,
                "eval_loss": self.eval_losses[-1][1] if self.eval_losses else None,
                "nvme_bytes_steps": (steps_to_run - warmup) if io_start else None,
                "disk_busy": busy,
            },
        )

    def close(self):
        """DeepSpeed 0.19.8 aborts at interpreter exit with 2 ranks and param offload unless the engine and the
        process group are torn down explicitly."""
        engine, self.engine = self.engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.destroy()
            self.remove_deepspeed_swap()
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _write_metrics(run: Run, metrics: dict, failed: bool) -> None:
    from aidaptiv_ds.common.metrics import write_json

    path = run.args.metrics_out
    if not path:
        return
    if run.rank == 0:
        write_json(path, metrics)
    elif failed:
        # Rank 0 may be stuck in a collective waiting for us: leave the reason where the caller looks,
        # unless rank 0 has written it already.
        write_json(path, metrics, exclusive=True)


def run(args) -> int:
    ensure_single_process_env()
    # DeepSpeed 0.19.8 calls collectives that torch 2.13 deprecates, once per step; say nothing about them.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    from aidaptiv_ds.common.metrics import one_line

    job = Run(args)
    status, error, metrics, where = "ok", None, None, None
    try:
        job.prepare()
        job.build()
        metrics = job.train()
    except KeyboardInterrupt:
        status, error = "error", "interrupted"
    except BaseException as exc:  # noqa: BLE001 - every failure must end in one clear line and a status
        if isinstance(exc, SystemExit):
            raise
        known = isinstance(exc, (TrainingFailed, ValueError, OSError))
        try:
            oom = _is_oom(exc)
        except ImportError:
            oom = isinstance(exc, MemoryError)
        if (not known and not oom) or args.verbose:
            traceback.print_exc(file=sys.stderr)
        status = "oom" if oom else "refused" if isinstance(exc, DoesNotFit) else "error"
        if status == "error":
            # A known error's one line says what to do; where it came from goes to the metrics, so a failure on a
            # machine one can no longer reach (a sweep cell, a lent GPU) can still be traced.
            where = traceback.format_exc(limit=-12)
        # A config's problems are all said at once (ConfigError lists them); other errors by their last line.
        listed = getattr(exc, "problems", None)
        if isinstance(listed, list) and len(listed) > 1:
            error = f"{type(exc).__name__}: " + str(exc).strip()
        else:
            error = str(exc) if isinstance(exc, TrainingFailed) else _last_line(exc)
    finally:
        job.close()
    if status != "ok":
        metrics = {
            "status": status,
            "error": error,
            **job.info,
            "steps": getattr(job, "steps", args.steps),
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
        print(f"aidaptiv-ds train: cannot write --metrics-out {args.metrics_out}: {e}", file=sys.stderr, flush=True)
        if where:
            print(where, file=sys.stderr, flush=True)
    if job.rank == 0 or status != "ok":
        print(one_line(metrics) if job.rank == 0 else f"rank {job.rank}: {one_line(metrics)}", flush=True)
    return {"ok": EXIT_OK, "oom": EXIT_OOM, "refused": EXIT_OOM}.get(status, EXIT_ERROR)
