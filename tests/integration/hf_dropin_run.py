"""One short fine-tuning run started the way users start one, for tests/integration/test_hf_dropin.py.

    deepspeed --num_accelerators 1 hf_dropin_run.py trainer --config ds.json --out run.json [--save DIR]
    deepspeed --num_accelerators 1 hf_dropin_run.py sft --config ds.json --out run.json
    accelerate launch --config_file acc.yaml hf_dropin_run.py accelerate --out run.json

``trainer`` is the Hugging Face Trainer with ``--deepspeed`` (TrainingArguments made first, so that the model
is built under ``deepspeed.zero.Init`` with the config's "auto" values still in it; ``--model-first`` builds
the model before, so that only ``deepspeed.initialize`` sees the config, filled). ``sft`` is TRL's
SFTTrainer with the same config. ``accelerate`` is a plain loop on ``Accelerator`` whose DeepSpeed config
comes from the accelerate config file. Nothing here knows about aidaptiv: the config's block decides.

Writes to ``--out`` the exact loss of every step (the trainers log them rounded to 4 digits), the
reduce-bucket size and persistence threshold DeepSpeed trained with, and whether our swapper ran.
``--save DIR`` ends with ``trainer.save_model(DIR)``.

``--lora`` trains LoRA adapters (PEFT) instead of the whole model: ``trainer`` wraps the built model with
``get_peft_model`` itself, ``sft`` hands TRL a ``peft_config`` and lets TRL wrap it. The run then also writes
the names and element count of the parameters that require gradients and our swapper's cumulative NVMe write
bytes when training begins and at the end of every step (``nvme_write_bytes_steps``, 1 + steps values), so
that the test sees what each step wrote.
"""

import argparse
import json
import sys

import torch

SEQ, BATCH, SAMPLES, LR, SEED = 64, 2, 32, 1e-4, 0
# LoRA B starts at zero: adapters need a larger rate than 1e-4 to move the loss visibly in 3 steps.
LORA_LR, LORA_R, LORA_ALPHA, LORA_TARGETS = 1e-2, 8, 16, ["q_proj", "v_proj"]


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=LORA_R,
        lora_alpha=LORA_ALPHA,
        target_modules=LORA_TARGETS,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def model_config():
    from aidaptiv_ds.models.presets import preset_config

    return preset_config("micro")


def token_rows(vocab):
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (SAMPLES, SEQ), generator=g)


def build_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(model_config())


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def recording(trainer_cls):
    """``trainer_cls`` that keeps the exact loss of every training step and, when our swapper runs, its
    cumulative NVMe write bytes when training begins and at the end of every step (after the optimizer step
    and its write-back)."""
    from transformers import TrainerCallback

    class WriteBytes(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def record(self):
            stats = getattr(self.trainer.model_wrapped, "aidaptiv_stats", None)
            if callable(stats):
                self.trainer.write_bytes.append(stats()["nvme_write_bytes"])

        def on_train_begin(self, args, state, control, **kwargs):
            self.record()  # the engine is made: the base is in the swap space

        def on_step_end(self, args, state, control, **kwargs):
            self.record()

    class Recording(trainer_cls):
        losses = []
        write_bytes = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(WriteBytes(self))

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss))
            return loss

    return Recording


def trainable(model):
    """Names and element count (partitioned or not) of the parameters that require gradients."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
    return {"trainable_names": names, "trainable_params": numel}


def engine_facts(engine):
    stats = engine.aidaptiv_stats() if hasattr(engine, "aidaptiv_stats") else None
    return {
        "swapper": stats is not None,
        "nvme_read_bytes": stats["nvme_read_bytes"] if stats else 0,
        "reduce_bucket_size": engine.zero_reduce_bucket_size(),
        "persistence_threshold": engine.zero_param_persistence_threshold(),
        "persistent_params": len(getattr(engine.optimizer, "persistent_parameters", [])),
    }


def common_args(a):
    return dict(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=BATCH,
        learning_rate=LORA_LR if a.lora else LR,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=SEED,
        deepspeed=a.config,
    )


def run_trainer(a):
    from transformers import Trainer, TrainingArguments

    model = build_model() if a.model_first else None
    args = TrainingArguments(**common_args(a))
    if model is None:
        model = build_model()  # under deepspeed.zero.Init: TrainingArguments registered the ZeRO-3 config
    rows = token_rows(model.config.vocab_size)
    if a.lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())  # the user's own wrapping, before the Trainer
    trainer = recording(Trainer)(model=model, args=args, train_dataset=Rows(rows))
    trainer.train()
    if a.save:
        trainer.save_model(a.save)
    return trainer.losses, {**engine_facts(trainer.model_wrapped), **lora_facts(a, trainer)}


def lora_facts(a, trainer):
    if not a.lora:
        return {}
    return {**trainable(trainer.model), "nvme_write_bytes_steps": trainer.write_bytes}


def run_sft(a):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    # fp32 (TRL defaults to bf16); everything else as TRL sets it, gradient checkpointing included.
    args = SFTConfig(**common_args(a), bf16=False)
    model = build_model()
    vocab = model.config.vocab_size
    # A word-level tokenizer over the ids themselves: the rows are already tokenized, and TRL wants one for
    # padding and special tokens; nothing is downloaded.
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0")),
        unk_token="0",
        pad_token="1",
        eos_token="2",
    )
    data = Dataset.from_dict({"input_ids": token_rows(vocab).tolist()})
    extra = {"peft_config": lora_config()} if a.lora else {}  # TRL wraps the model with PEFT itself
    trainer = recording(SFTTrainer)(model=model, args=args, train_dataset=data, processing_class=tok, **extra)
    trainer.train()
    return trainer.losses, {**engine_facts(trainer.model_wrapped), **lora_facts(a, trainer)}


def run_accelerate(a):
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler

    accelerator = Accelerator()
    model = build_model()  # under deepspeed.zero.Init when the accelerate config sets zero3_init_flag
    rows = token_rows(model.config.vocab_size)
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)
    # The DeepSpeed config names the optimizer and scheduler: accelerate then takes these placeholders.
    optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=0.0)
    scheduler = DummyScheduler(optimizer, warmup_num_steps=1, total_num_steps=a.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    for _, ids in zip(range(a.steps), loader):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    facts = engine_facts(model)
    accelerator.end_training()
    return losses, facts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("trainer", "sft", "accelerate"))
    p.add_argument("--config", help="DeepSpeed config (trainer, sft; accelerate takes it from its own config)")
    p.add_argument("--out", required=True)
    p.add_argument("--output_dir", default="out")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save")
    p.add_argument("--model-first", action="store_true")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT) on the frozen model")
    p.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    a = p.parse_args()
    losses, facts = {"trainer": run_trainer, "sft": run_sft, "accelerate": run_accelerate}[a.mode](a)
    with open(a.out, "w") as f:
        json.dump({"losses": losses, **facts}, f)
    print("losses", losses, facts)


if __name__ == "__main__":
    sys.exit(main())
