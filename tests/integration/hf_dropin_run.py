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
"""
import argparse
import json
import sys

import torch

SEQ, BATCH, SAMPLES, LR, SEED = 64, 2, 32, 1e-4, 0


def model_config():
    from aidaptiv_ds.models import preset_config
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
    """``trainer_cls`` that keeps the exact loss of every training step."""
    class Recording(trainer_cls):
        losses = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss))
            return loss
    return Recording


def engine_facts(engine):
    stats = engine.aidaptiv_stats() if hasattr(engine, "aidaptiv_stats") else None
    return {"swapper": stats is not None, "nvme_read_bytes": stats["nvme_read_bytes"] if stats else 0,
            "reduce_bucket_size": engine.zero_reduce_bucket_size(),
            "persistence_threshold": engine.zero_param_persistence_threshold(),
            "persistent_params": len(getattr(engine.optimizer, "persistent_parameters", []))}


def common_args(a):
    return dict(output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=BATCH,
                learning_rate=LR, logging_steps=1, report_to="none", save_strategy="no", seed=SEED,
                deepspeed=a.config)


def run_trainer(a):
    from transformers import Trainer, TrainingArguments
    model = build_model() if a.model_first else None
    args = TrainingArguments(**common_args(a))
    if model is None:
        model = build_model()  # under deepspeed.zero.Init: TrainingArguments registered the ZeRO-3 config
    rows = token_rows(model.config.vocab_size)
    trainer = recording(Trainer)(model=model, args=args, train_dataset=Rows(rows))
    trainer.train()
    if a.save:
        trainer.save_model(a.save)
    return trainer.losses, engine_facts(trainer.model_wrapped)


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
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({str(i): i for i in range(vocab)},
                                                                               unk_token="0")),
                                  unk_token="0", pad_token="1", eos_token="2")
    data = Dataset.from_dict({"input_ids": token_rows(vocab).tolist()})
    trainer = recording(SFTTrainer)(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    return trainer.losses, engine_facts(trainer.model_wrapped)


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
    p.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    a = p.parse_args()
    losses, facts = {"trainer": run_trainer, "sft": run_sft, "accelerate": run_accelerate}[a.mode](a)
    with open(a.out, "w") as f:
        json.dump({"losses": losses, **facts}, f)
    print("losses", losses, facts)


if __name__ == "__main__":
    sys.exit(main())
