#!/usr/bin/env python3
"""Fine-tune with Hugging Face Trainer and DeepSpeed; nothing here knows about aidaptiv.

    deepspeed --num_accelerators 1 examples/hf_trainer_finetune.py --deepspeed ds_configs/aidaptiv.json \\
        --output_dir out --max_steps 5

ds_configs/hf_trainer_zero3_aidaptiv.json (the Hugging Face docs' ZeRO-3 config, "auto" values and all, with
the block) works the same way. With an "aidaptiv" block in the config (and aidaptiv-ds installed, which
hooks deepspeed at start-up), the
parameters and optimizer state live on NVMe through our swapper; with any other ZeRO-3 config this is a
plain DeepSpeed run. The TrainingArguments the Hugging Face integration checks against a config's numbers
(batch size, accumulation, clipping, learning rate, Adam's settings) default to the config's own, so a config
written for DeepSpeed runs as it is; --resume_from_checkpoint is passed to ``trainer.train``. --model takes a preset of aidaptiv_ds.models.presets (random weights) or a local HF directory.
--step_times_out FILE writes each optimizer step's wall time (a TrainerCallback, from on_step_begin to
on_step_end: data, forward, backward and step), peak RSS and, when the engine has it, its aidaptiv_stats().
"""

import json
import resource
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments


@dataclass
class ModelArguments:
    model: str = field(default="micro", metadata={"help": "preset name or local Hugging Face model directory"})
    seq_len: int = field(default=64, metadata={"help": "tokens per packed sequence"})
    step_times_out: str = field(default=None, metadata={"help": "write per-step wall times (JSON) here"})


def proc_io():
    """This process's block-device (read, write) bytes so far, or None without /proc/self/io."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


class StepTimes(TrainerCallback):
    """Wall time of every optimizer step, as the Trainer's own callbacks see it, and the block-device bytes
    read and written so far at the end of each."""

    def __init__(self):
        self.step_s = []
        self.io_bytes = []
        self._t0 = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_s.append(time.perf_counter() - self._t0)
        self.io_bytes.append(proc_io())


class PackedDataset(torch.utils.data.Dataset):
    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        ids = torch.tensor(self.blocks[i], dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


# TrainingArguments flags and the DeepSpeed config numbers the Hugging Face integration checks them against
# (a config with numbers instead of "auto" must agree with the Trainer, or training stops before it starts).
FROM_CONFIG = (
    ("--per_device_train_batch_size", ("train_micro_batch_size_per_gpu",)),
    ("--gradient_accumulation_steps", ("gradient_accumulation_steps",)),
    ("--max_grad_norm", ("gradient_clipping",)),
    ("--learning_rate", ("optimizer", "params", "lr")),
    ("--weight_decay", ("optimizer", "params", "weight_decay")),
    ("--adam_epsilon", ("optimizer", "params", "eps")),
)


def with_config_numbers(argv):
    """``argv`` with the TrainingArguments flags it does not set taken from the --deepspeed config's numbers,
    so that a config written for DeepSpeed (ds_configs/aidaptiv.json) runs as it is; flags on the command
    line win, and "auto" values are left to the Trainer."""
    path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--deepspeed"), None)
    path = path or next((a.split("=", 1)[1] for a in argv if a.startswith("--deepspeed=")), None)
    if not path:
        return argv
    import hjson  # DeepSpeed reads its configs with hjson (comments allowed)

    with open(path) as f:
        cfg = hjson.load(f)
    out = list(argv)
    for flag, keys in FROM_CONFIG:
        value = cfg
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and not any(a == flag or a.startswith(flag + "=") for a in argv):
            out += [flag, str(value)]
    betas = ((cfg.get("optimizer") or {}).get("params") or {}).get("betas")
    if isinstance(betas, list) and len(betas) == 2 and not any(a.startswith("--adam_beta") for a in argv):
        out += ["--adam_beta1", str(betas[0]), "--adam_beta2", str(betas[1])]
    return out


def main():
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    margs, targs = parser.parse_args_into_dataclasses(args=with_config_numbers(sys.argv[1:]))
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.job.data import DEFAULT_DATA, build_batches
    from aidaptiv_ds.models.presets import resolve
    from aidaptiv_ds.models.tokenizer import tokenizer_for

    spec = resolve(margs.model)
    torch.manual_seed(targs.seed)
    # Made after TrainingArguments: with a ZeRO-3 --deepspeed config, transformers builds the model under
    # deepspeed.zero.Init, so its partitions go straight to the swap space.
    if spec.hf_dir is None:
        model = AutoModelForCausalLM.from_config(spec.config)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec.hf_dir, local_files_only=True)
    batches = build_batches(DEFAULT_DATA, tokenizer_for(spec), margs.seq_len, 1, targs.seed, 0, 1)
    blocks = [batches.batch(i)["input_ids"][0].tolist() for i in range(64)]
    times = StepTimes()
    trainer = Trainer(model=model, args=targs, train_dataset=PackedDataset(blocks), callbacks=[times])
    result = trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    stats = getattr(trainer.model_wrapped, "aidaptiv_stats", None)
    if targs.process_index == 0:
        print(
            f"train_loss={result.training_loss:.4f} losses={[h['loss'] for h in trainer.state.log_history if 'loss' in h]}"
        )
        print(
            "aidaptiv swapper active" if stats else "aidaptiv swapper not active",
            f"nvme_read_bytes={stats()['nvme_read_bytes']}" if stats else "",
        )
        if stats and stats().get("activations"):
            print(f"activations={json.dumps(stats()['activations'])}")
        if margs.step_times_out:
            record = {
                "step_s": times.step_s,
                "io_bytes_at_step_end": times.io_bytes,
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                "aidaptiv_stats": stats() if stats else None,
            }
            with open(margs.step_times_out, "w") as f:
                json.dump(record, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
