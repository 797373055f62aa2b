"""One training run, as a recipe over its parts: :class:`Run` prepares (config, model spec, data: everything that
can fail cheaply), builds (DeepSpeed, the model, adapters), trains, and closes.

The model is a preset shape with random weights (micro, tiny, llama2-7b, ...) or a local Hugging Face directory;
the data is a file or folder of instruction records (JSONL, JSON, CSV, Parquet or a datasets save_to_disk
folder; the packaged set by default), rendered through the tokenizer's chat template when it has one, packed
into sequences of exactly ``seq_len`` tokens. The run makes ``steps`` optimizer steps or ``epochs`` passes over
the data, can hold records out and report their loss (``eval_fraction`` / ``eval_data``, ``eval_every``),
follow a learning-rate schedule with warm-up (``lr_schedule``, ``warmup_steps``), and save, resume and write
its model out (:mod:`aidaptiv_ds.job.checkpoints`). Every step is timed by phase
(:class:`aidaptiv_ds.common.metrics.StepTimer`) and the swap disk metered
(:class:`aidaptiv_ds.common.metrics.IOMeter`); :meth:`Run.train` returns the metrics: tokens/s, the median step
time after ``warmup`` steps, the loss trajectory (mean over ranks), peak host/GPU memory and the NVMe bytes
the ranks read and wrote. With DeepSpeed's "csv_monitor", "tensorboard" or "wandb" sections, every step's
series go to them (aidaptiv_ds.common.metrics.MONITOR_SERIES); W&B runs offline into the metrics folder unless
WANDB_MODE / WANDB_DIR say otherwise (aidaptiv_ds.job.wandb_env).

Run directly it is a 1-process job (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are set when absent); under the
deepspeed launcher or torchrun it is one rank of many (gloo on CPU, nccl on CUDA); started by srun (by hand or
DeepSpeed's --launcher slurm), it takes its rank, world size and rendezvous from SLURM's variables
(aidaptiv_ds.job.rank_env). ``aidaptiv-ds train`` (:mod:`aidaptiv_ds.commands.train`) turns the outcome into
the metrics file and an exit status.
"""

from __future__ import annotations

__all__ = ["Run"]

import contextlib
import datetime
import logging
import os
import random
import sys
import time
from typing import Callable, Optional

from aidaptiv_ds.job import engine_report, run_config
from aidaptiv_ds.job.checkpoints import RunCheckpoints
from aidaptiv_ds.job.evaluation import write_logits
from aidaptiv_ds.job.failures import DoesNotFit, TrainingFailed, gather_peers
from aidaptiv_ds.job.moe import router_loss
from aidaptiv_ds.job.rank_env import make_nvme_path
from aidaptiv_ds.job.settings import TrainSettings
from aidaptiv_ds.job.step_monitor import StepMonitor


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

    def __init__(self, settings: TrainSettings, say: Optional[Callable[[str], None]] = None):
        self.settings = settings
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.info: dict = {}
        self.engine = None
        self.collectives = None  # a CollectiveTimer with --time-collectives
        self.checkpoints = RunCheckpoints(self)

    def log(self, msg: str) -> None:
        """A line for the user, from rank 0 (the command prefixes it and says backquoted settings as flags)."""
        if self.rank == 0:
            self.say(msg)

    def prepare(self):
        """Config, model spec, data: everything that can fail cheaply, before DeepSpeed starts."""
        from aidaptiv_ds.config import ds_config
        from aidaptiv_ds.job import train_plan
        from aidaptiv_ds.models import presets as models
        from aidaptiv_ds.models.tokenizer import tokenizer_for

        a = self.settings
        # Every problem of the settings, of the places the run writes and of the config's swap folders, at once.
        found = train_plan.problems(a)
        if a.create_nvme_path and not a.nvme_path:
            found.append("`create_nvme_path` needs `nvme_path`: give the swap folder to make on this node")
        found += train_plan.output_problems(a)
        from aidaptiv_ds.job.record_files import DataError, form_of

        for name, path in (("data", a.data), ("eval_data", a.eval_data)):
            try:
                if path:
                    form_of(path)  # there, and of a form the job reads (the records are read below)
            except DataError as e:
                found.append(f"`{name}`: {e}")
        if a.resume_from:
            from aidaptiv_ds.job.checkpoints import resolve_resume

            try:
                resolve_resume(a.resume_from)
            except TrainingFailed as e:
                found.append(str(e))
        cfg = None
        try:
            cfg = ds_config.load(a.config, what="`config`")
            cfg = ds_config.apply_overrides(
                cfg,
                micro_batch=a.micro_batch,
                grad_accum=a.grad_accum,
                lr=a.lr,
                nvme_path=os.path.abspath(a.nvme_path) if a.nvme_path else None,
                host_budget=a.host_budget,
            )
        except ds_config.ConfigError as e:
            found += e.problems
        if cfg is not None:
            given = {  # the config's values these flags replace: the flags' own values are checked above
                "train_micro_batch_size_per_gpu": a.micro_batch,
                "gradient_accumulation_steps": a.grad_accum,
                ds_config.LR_KEY: a.lr,
            }
            found += ds_config.number_problems(cfg, skip=[k for k, v in given.items() if v is not None])
            for block in ds_config.nvme_blocks(cfg):  # relative paths mean the working directory, as in DeepSpeed;
                if block["nvme_path"]:  # made absolute so that logs and metrics are unambiguous
                    block["nvme_path"] = os.path.abspath(block["nvme_path"])
            found += run_config.swap_problems(cfg, a.nvme_path, a.create_nvme_path)
        if found:
            raise TrainingFailed("; ".join(found))
        if a.create_nvme_path:  # before the config check, which refuses a missing folder
            self.info["nvme_path_created"] = make_nvme_path(os.path.abspath(a.nvme_path))
        self.lora = None
        if a.lora:
            from aidaptiv_ds.common.extras import missing, missing_message
            from aidaptiv_ds.job.lora import parse_spec

            self.lora = parse_spec(a.lora)
            if self.lora.bits == 4 and missing("bitsandbytes"):  # said before the model is built, not after
                raise ValueError(missing_message("`lora` bits=4 (QLoRA)", ["bitsandbytes"]))
        if a.gradient_checkpointing:
            cfg, applied = run_config.checkpointing_in_block(cfg)
            if applied:
                self.info["gradient_checkpointing"] = applied
        else:
            cfg = run_config.auto_activations_by_default(cfg)
        self.spec = models.resolve(a.model, log=self.log)
        moe = router_loss(self.spec, self.settings.router_aux_loss_coef)
        if moe:
            self.info["moe"], line = moe
            self.log(line)
        import torch

        self.cuda = torch.cuda.is_available()
        precision, why = run_config.choose_precision(a.dtype, ds_config.dtype_name(cfg), self.spec.config, self.cuda)
        cfg = ds_config.apply_overrides(cfg, dtype=precision if precision != ds_config.dtype_name(cfg) else None)
        self.info["precision_reason"] = why
        self.log(f"precision: {precision}: {why}")
        ds_config.check(
            cfg,
            world_size=self.world_size,
            largest_param_numel=self.spec.largest_parameter_numel,
            model_name=self.spec.name,
            cuda=self.cuda,
        )
        self.cfg = cfg
        self.backend = ds_config.backend(cfg)
        run_config.check_tensorboard(cfg)
        wandb = run_config.wandb_settings(cfg, a.metrics_out)
        if wandb:
            self.info["wandb"] = wandb
        self.check_fits(cfg)
        if a.output_dir and self.backend != "aidaptiv":
            raise TrainingFailed(
                f'`output_dir` needs a config with an enabled "aidaptiv" block (this one runs '
                f"{self.backend}): the export reads the checkpoint our swapper writes; for plain "
                "DeepSpeed save with `save_dir` and convert with DeepSpeed's zero_to_fp32.py"
            )
        if a.output_dir:
            from aidaptiv_ds.job.export import out_problem

            problem = out_problem(a.output_dir)
            if problem:
                raise TrainingFailed(f"`output_dir`: {problem}")
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

    def prepare_data(self, cfg: dict) -> str:
        """Training stream and held-out batches, the run's step count, and the lr schedule that needs it."""
        from aidaptiv_ds.job import data as D
        from aidaptiv_ds.job import lr_schedule, train_plan

        a = self.settings
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
            what = f"`eval_data` {a.eval_data}" if a.eval_data else f"the held-out {a.eval_fraction:g} of {data_path}"
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
                self.log(f"`lr_schedule` {a.lr_schedule} replaces the config's scheduler section")
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

    def check_fits(self, cfg: dict) -> None:
        """Refuse, before a byte is written, a job the plan says this node cannot hold (every problem, in full),
        unless ``no_fit_check`` asks to start anyway (then warn)."""
        from aidaptiv_ds.config import ds_config

        a = self.settings
        problems = run_config.fit_problems(self.spec, cfg, a.seq_len, self.world_size, self.cuda, self.lora is not None)
        if not problems:
            return
        text = str(ds_config.ConfigError(problems, source=f"plan for {self.spec.name}"))
        if a.no_fit_check:
            self.info["fit_check"] = {"skipped": True, "problems": problems}
            self.say(f"warning: `no_fit_check`: starting although {text}")
            return
        raise DoesNotFit(text)  # every problem, in full (a ConfigError would be cut to its last line by run())

    def build(self):
        import deepspeed
        import torch

        a = self.settings
        if not a.verbose:
            from aidaptiv_ds.zero3.compat import set_deepspeed_log_level

            set_deepspeed_log_level(logging.WARNING)
        random.seed(a.seed)
        torch.manual_seed(a.seed)
        if a.time_collectives:  # before the process group: DeepSpeed keeps the collectives it finds then
            from aidaptiv_ds.job.collective_timer import CollectiveTimer

            self.collectives = CollectiveTimer()
            self.collectives.install()
        # gloo and nccl fail a collective that waits longer than this (a lost node, a cut link): bounded by us
        deepspeed.init_distributed(timeout=datetime.timedelta(seconds=a.peer_timeout))
        # DeepSpeed's CPU communicator leaves a 66 MiB /dev/shm segment per rank behind (see dist_shm).
        from aidaptiv_ds.zero3 import dist_shm

        dist_shm.release_after_barrier()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if a.gpu_mem_cap_gb:
                total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, a.gpu_mem_cap_gb * 2**30 / total))
        self.peers = gather_peers(self.world_size)
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
        if a.gradient_checkpointing and self.backend != "aidaptiv":
            self.enable_gradient_checkpointing(model)
        if self.lora is not None:
            model = self.add_adapters(model)
        if stage3:
            # Every ZeRO-3 backend, stock ones too, with the MoE blocks as leaf modules (aidaptiv_ds.zero3.moe), so
            # that stock and aidaptiv runs differ only in where the state lives.
            from aidaptiv_ds.zero3.moe import mark_moe_blocks

            blocks = mark_moe_blocks(model)
            if blocks:
                self.info.setdefault("moe", {})["leaf_blocks"] = len(blocks)
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
        self.info.update(
            engine_report.loss_chunking(model, self.micro_batch * self.settings.seq_len, self.spec.config.vocab_size)
            or {}
        )

    def check_saveable(self) -> None:
        """A run that will save (--save-dir, --output-dir) learns before its first step whether its swapped
        state can be saved, instead of losing every step to a refusal at its first checkpoint."""
        a = self.settings
        ask = getattr(self.engine, "aidaptiv_save_problem", None)
        if not (a.save_dir or a.output_dir) or not callable(ask):
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
        self.log(f"gradient checkpointing: {self.info['gradient_checkpointing']}")

    def add_adapters(self, model):
        """--lora: PEFT's adapters on the built (and, under ZeRO-3, partitioned) base, which is frozen."""
        from aidaptiv_ds.job import lora

        model = lora.apply(model, self.lora)
        if self.dtype is not None:  # adapters are made in fp32; train them in the base's dtype
            for p in model.parameters():
                if p.requires_grad and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
        self.info["lora"] = {"spec": self.lora.describe(), "trainable_params": lora.trainable_numel(model)}
        self.log(f"{self.lora.describe()}: {self.info['lora']['trainable_params']:,} trainable parameters")
        return model

    def note_io_settings(self) -> None:
        """Log, and keep for the metrics, the swapper's I/O settings (engine_report.io_settings)."""
        got = engine_report.io_settings(self.cfg) if self.backend == "aidaptiv" else None
        if got:
            self.info["aidaptiv_io"], line = got
            self.log(line)

    def check_partition_dtype(self, model) -> None:
        """Every backend trains in the dtype the config asks for, or the job stops here saying why."""
        problem = engine_report.partition_dtype_problem(model, self.dtype)
        if problem:
            raise TrainingFailed(problem)

    def remove_deepspeed_swap(self) -> None:
        """ZeRO-Infinity leaves every weight and optimizer moment in its swap files after the run: this rank's go
        (useless once the engine is gone; checkpoints hold their own copy) unless --keep-swap, and the log says
        which. Our own swapper (backend aidaptiv) cleans up after itself."""
        if getattr(self, "backend", None) != "zero_infinity":
            return
        from aidaptiv_ds.zero3.compat import remove_zero_infinity_swap

        paths, keep = self.info.get("nvme_paths") or [], self.settings.keep_swap
        dirs = remove_zero_infinity_swap(paths, self.rank, keep)
        if dirs:
            self.info["swap_kept" if keep else "swap_removed"] = dirs
            self.log(f"{'kept' if keep else 'removed'} DeepSpeed swap files in {', '.join(dirs)}")

    def host_budget_bytes(self) -> int | None:
        """This rank's resolved host budget (the config's own settings object, resolved once), or None."""
        if self.backend != "aidaptiv":
            return None
        from aidaptiv_ds.config import resolve as C

        settings = C.resolve(self.cfg)[1]
        return settings.host_budget_bytes if settings else None

    def current_lr(self) -> float | None:
        """The lr the optimizer's next update uses (its first parameter group's)."""
        with contextlib.suppress(Exception):
            return float(self.engine.get_lr()[0])
        return None

    def run_eval(self, step: int, monitor) -> None:
        """The held-out loss after optimizer step ``step``: into the metrics, the log and the monitors."""
        from aidaptiv_ds.job.evaluation import evaluate

        t0 = time.perf_counter()
        # A mixture of experts is evaluated on its language-model loss alone (no load-balancing term).
        loss = evaluate(self.engine, self.eval_batches, {"output_router_logits": False} if self.spec.is_moe else None)
        self.eval_losses.append([step, loss])
        self.log(
            f"step {step}: eval loss {loss:.4f} on {self.eval_batches.sequences} held-out "
            f"sequence(s) ({time.perf_counter() - t0:.1f} s)"
        )
        if monitor.enabled:
            monitor.write_eval(step, loss)

    def train(self) -> dict:
        import torch
        import torch.distributed as dist

        from aidaptiv_ds.common import metrics as M
        from aidaptiv_ds.job.train_plan import eval_due

        a, engine = self.settings, self.engine
        sync = torch.cuda.synchronize if self.cuda else None
        timer = M.StepTimer(sync)
        client = self.checkpoints.resume()
        start, position, losses = int(client["step"]), int(client["data_position"]), list(client["losses"])
        self.losses = losses  # the same list: a failure after some steps still reports them (run())
        # per step, what the run before a resume recorded (None for a checkpoint older than these fields)
        self.lrs = list(client.get("lrs") or [None] * start)
        self.eval_losses = [list(e) for e in client.get("eval_losses") or []]
        # A mixture's load-balancing loss per step (None for a checkpoint older than the field)
        aux_losses = self.aux_losses = list(client.get("aux_losses") or [None] * start) if self.spec.is_moe else []
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
        engine.train()
        monitor = StepMonitor(engine, self.rank, self.host_budget_bytes(), self.cuda)
        from aidaptiv_ds.engine.disk import block_device

        # Evaluations and saves inside the timed window are not the training steps' disk traffic.
        meter = M.IOMeter([block_device(p)["device"] for p in self.info.get("nvme_paths") or [] if os.path.isdir(p)])
        for i, step in enumerate(range(start, steps)):
            if i == warmup:
                meter.start()
            step_io = M.proc_io() if monitor.enabled else None
            self.lrs.append(self.current_lr())  # what this step's update uses
            timer.start_step()
            if self.collectives:
                self.collectives.start_step()
            micro_losses, micro_aux = [], []
            for _ in range(self.grad_accum):
                batch = {k: v.to(device) for k, v in self.batches.batch(position).items()}
                position += 1
                t = timer.now()
                out = engine(**batch)
                loss = out.loss
                t1 = timer.now()
                engine.backward(loss)
                t2 = timer.now()
                engine.step()
                t3 = timer.now()
                timer.add("forward", t1 - t)
                timer.add("backward", t2 - t1)
                timer.add("optimizer", t3 - t2)
                micro_losses.append(loss.detach().float())
                if getattr(out, "aux_loss", None) is not None:
                    micro_aux.append(out.aux_loss.detach().float())
            step_s = timer.end_step()
            if self.collectives:
                self.collectives.end_step()
            step_loss = torch.stack(micro_losses).mean().to(torch.float64)
            dist.all_reduce(step_loss)
            losses.append(step_loss.item() / self.world_size)
            if micro_aux:  # the router's load-balancing loss (before its weight), mean over micro-steps and ranks
                step_aux = torch.stack(micro_aux).mean().to(torch.float64)
                dist.all_reduce(step_aux)
                aux_losses.append(step_aux.item() / self.world_size)
            if i == 0:
                plan = engine_report.activation_plan(engine)
                if plan:
                    self.log(plan)
            if monitor.enabled:
                monitor.write_step(step + 1, timer.steps[-1], losses[-1], tokens_per_step, step_io)
            if self.eval_batches is not None and eval_due(step + 1, a.eval_every, steps):
                meter.outside_steps(lambda: self.run_eval(step + 1, monitor))
            if a.save_dir and a.save_every and (step + 1) % a.save_every == 0 and step + 1 < steps:
                meter.outside_steps(lambda: self.checkpoints.save(step + 1, position, losses))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_step / step_s:.0f}")
        meter.stop()
        if bar is not None:
            bar.close()
        if a.save_dir and steps_to_run > 0:
            self.checkpoints.save(steps, position, losses)
        if a.output_dir:
            self.checkpoints.write_output(steps, position, losses)
        if a.logits_out:
            write_logits(self.engine, self.batches.batch(0), a.logits_out, self.rank)

        # Reduce what each rank measured: bytes add up, peaks take the max.
        nvme = meter.bytes()
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
                "aux_losses": aux_losses if any(x is not None for x in aux_losses) else None,
                "eval_loss": self.eval_losses[-1][1] if self.eval_losses else None,
                "nvme_bytes_steps": (steps_to_run - warmup) if meter.started else None,
                "disk_busy": meter.busy(),
                "collectives_s": self.collectives.summary(warmup) if self.collectives else None,
            },
        )

    def close(self):
        """DeepSpeed 0.19.8 aborts at interpreter exit with 2 ranks and param offload unless the engine and the
        process group are torn down explicitly."""
        engine, self.engine = self.engine, None
        if self.collectives:
            self.collectives.uninstall()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.destroy()
            self.remove_deepspeed_swap()
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
