"""The DeepSpeed config as one training run uses it: the activation policy the run's settings imply, where W&B
writes, whether the plan says the job fits this node and whether its swap folders can be used, all decided before
DeepSpeed starts."""

from __future__ import annotations

import copy
import os
from typing import List, Optional, Tuple

from aidaptiv_ds.job.failures import TrainingFailed


def _enabled_block(cfg: dict) -> Optional[dict]:
    block = cfg.get("aidaptiv")
    return block if isinstance(block, dict) and block.get("enabled") else None


def auto_activations_by_default(cfg: dict) -> dict:
    """A block that names no activations policy runs this job with policy "auto": the job's models all have the
    block list auto plans over, so a long sequence trains within the memory the process may use (its cgroup's
    limit included) without the user naming a policy, and a short one keeps everything as "keep" would. The
    block's own default stays "keep" for other programs (a plain script's model may have no block list), and the
    shipped configs do not write "auto": the Hugging Face Trainer and accelerate take any "auto" string in a
    DeepSpeed config for one of theirs to fill, and refuse it."""
    block = _enabled_block(cfg)
    if block is None:
        return cfg
    activations = block.get("activations")
    if activations is None:
        activations = {}
    if not isinstance(activations, dict) or "policy" in activations:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg["aidaptiv"]["activations"] = {**activations, "policy": "auto"}
    return cfg


def checkpointing_in_block(cfg: dict) -> Tuple[dict, Optional[str]]:
    """``gradient_checkpointing`` with an "aidaptiv" block: the block's activation policy does the checkpointing
    (one mechanism, and "nvme" stores what it keeps), so the setting becomes policy "recompute" where the block
    names none; "recompute" and "nvme" already checkpoint; an explicit "keep" contradicts it. An explicit "auto"
    becomes "recompute" too (the setting is the more specific wish). Without the block the model itself is
    checkpointed when it is built. Returns (config, what was applied, or None without the block)."""
    block = _enabled_block(cfg)
    if block is None:
        return cfg, None
    activations = block.get("activations") or {}
    policy = activations.get("policy") if isinstance(activations, dict) else None
    if policy == "keep":
        raise TrainingFailed(
            "`gradient_checkpointing` asks to recompute activations but the config's "
            'aidaptiv.activations.policy is "keep": drop it, or set the policy to '
            '"recompute" (or "nvme", which also stores the checkpoints on NVMe)'
        )
    if policy in (None, "auto") and isinstance(activations, dict):
        cfg = copy.deepcopy(cfg)
        cfg["aidaptiv"]["activations"] = {**activations, "policy": "recompute"}
        policy = "recompute"
    return cfg, f"aidaptiv.activations.policy {policy}"


def check_tensorboard(cfg: dict) -> None:
    """DeepSpeed builds its TensorBoard monitor inside deepspeed.initialize, where a missing tensorboard package
    is a bare ImportError after the model is built: refuse it before, with the extra to install."""
    from aidaptiv_ds.common.extras import install_command, missing

    section = cfg.get("tensorboard")
    if isinstance(section, dict) and section.get("enabled") and missing("tensorboard"):
        raise ValueError(
            'the config\'s "tensorboard" section is enabled but the tensorboard package is not installed: '
            f'{install_command("tensorboard")}, or set "enabled": false'
        )


def wandb_settings(cfg: dict, metrics_out: Optional[str]) -> Optional[dict]:
    """With the config's "wandb" section on: W&B offline (unless WANDB_MODE says otherwise), its files in the
    metrics file's folder (else the working directory) unless WANDB_DIR says otherwise."""
    from aidaptiv_ds.job import wandb_env

    return wandb_env.prepare(cfg, os.path.dirname(os.path.abspath(metrics_out)) if metrics_out else os.getcwd())


def fit_problems(spec, cfg: dict, seq_len: int, world_size: int, cuda: bool, lora: bool) -> List[str]:
    """What the plan says this node's ranks cannot hold (swap space, host budget, host memory: the planner's
    figures, aidaptiv_ds.planner.guard), before a byte is written. Presets, Llama-shaped directories and the
    mixtures of experts the planner counts (planner.shapes.KNOWN) only: another architecture is sized once built."""
    from aidaptiv_ds.engine.machine import total_ram_bytes
    from aidaptiv_ds.planner.guard import launch_problems
    from aidaptiv_ds.planner.shapes import KNOWN, shape_of_config

    if getattr(spec.config, "model_type", None) not in KNOWN:
        return []
    micro = int(cfg.get("train_micro_batch_size_per_gpu") or 1)
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    return launch_problems(
        shape_of_config(spec.name, spec.config),
        cfg,
        world_size=world_size,
        local_world_size=min(local, world_size),
        seq_len=seq_len,
        micro_batch=micro,
        cuda=cuda,
        ram_bytes=total_ram_bytes(),
        lora=lora,
    )


_LONG = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def swap_problems(cfg: dict, nvme_path_flag: Optional[str], create_nvme_path: bool) -> List[str]:
    """The swap folders the run will use, by the rule every command applies
    (aidaptiv_ds.engine.disk.swap_folder_problem): one that exists, on a disk that takes O_DIRECT, writable.
    Made by the run instead when ``create_nvme_path`` says so (for the folder ``--nvme-path`` gave), and by
    DeepSpeed when its own swapper (ZeRO-Infinity's offload blocks) uses it: those are checked at the parent they
    will be made in. Problems name the flag when one gave the folder, else the config's key."""
    from aidaptiv_ds.config import ds_config
    from aidaptiv_ds.engine.disk import swap_folder_problem

    ours = ds_config.backend(cfg) == "aidaptiv"
    sections = [("aidaptiv", cfg.get("aidaptiv"))] if ours else []
    if not ours:  # with the aidaptiv block, DeepSpeed's offload blocks are ours (its check keeps them equal)
        zero = cfg.get("zero_optimization") or {}
        sections += [(f"zero_optimization.{k}", zero.get(k)) for k in ("offload_param", "offload_optimizer")]
    found, seen = [], set()
    for name, block in sections:
        if not isinstance(block, dict) or not block.get("nvme_path") or block["nvme_path"] in seen:
            continue  # an empty nvme_path is the config check's to report
        if name != "aidaptiv" and str(block.get("device", "none")).lower() != "nvme":
            continue
        path = block["nvme_path"]
        seen.add(path)
        made = name != "aidaptiv" or bool(
            create_nvme_path and nvme_path_flag and path == os.path.abspath(nvme_path_flag)
        )
        problem = swap_folder_problem(path, made_by_job=made)
        if problem:
            found.append(f"`nvme_path` {problem}" if nvme_path_flag else f"{name}.nvme_path {problem}")
    return found


def shipped_precision(config) -> Optional[str]:
    """The precision a model's weights ship in (fp32, bf16, fp16: its config's dtype), None for a preset."""
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(name).replace("torch.", "") if name is not None else None
    return _LONG.get(name)


def hardware_has(precision: str, cuda: bool) -> bool:
    """Whether this machine computes in ``precision`` natively: fp32 always; bf16 on a GPU that supports it or a
    CPU with AVX512-BF16 or AMX-BF16 (without them bf16 is emulated, several times slower than fp32); fp16 on
    a GPU only (DeepSpeed's CPU path does not train in fp16)."""
    if precision == "fp32":
        return True
    if cuda:
        import torch

        return precision == "fp16" or bool(torch.cuda.is_bf16_supported())
    if precision != "bf16":
        return False
    from aidaptiv_ds.engine.machine import cpu_flags

    flags = set(cpu_flags() or ())
    return bool(flags & {"avx512_bf16", "amx_bf16"}) or "bf16" in flags  # x86, or Arm's BF16 extension


def choose_precision(asked: Optional[str], configured: str, config, cuda: bool) -> Tuple[str, str]:
    """(precision, why) of a run: ``asked`` (the ``dtype`` setting: fp32, bf16, fp16, or "auto": the model's
    own where this machine has it), else the DeepSpeed config's. The why says when the model ships in another
    precision than the run uses, since that doubles the state and slows the steps (a bf16 model in fp32:
    2x the export, 16 instead of 8 bytes of optimizer state a parameter)."""
    shipped = shipped_precision(config)
    if asked and asked != "auto":
        return asked, "`dtype` " + asked
    if asked == "auto":
        if shipped and hardware_has(shipped, cuda):
            return shipped, f"`dtype` auto: the model's own ({shipped}), which this machine computes natively"
        if shipped:
            return "fp32", f"`dtype` auto: fp32, since this machine has no native {shipped} (the model ships in it)"
        return configured, f"`dtype` auto: the config's ({configured}; a preset has no precision of its own)"
    why = f"the config's ({configured})"
    if shipped and shipped != configured:
        native = hardware_has(shipped, cuda)
        why += f"; the model ships in {shipped}: `dtype` {shipped} (or auto) trains it in its own precision" + (
            ", which this machine computes natively" if native else " (emulated here, slower than fp32)"
        )
    return configured, why
