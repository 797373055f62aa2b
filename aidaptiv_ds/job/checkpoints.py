"""A training run's checkpoints: resuming from one (``resume`` / ``resume_from``), saving one (``save_dir``,
``save_every``) and writing the trained model out (``output_dir``), and the RNG state a checkpoint carries.

:class:`RunCheckpoints` is the run's component for them (:class:`aidaptiv_ds.job.train.Run` holds one); the files
themselves are DeepSpeed's and, with the aidaptiv block, the swapped state's (:mod:`aidaptiv_ds.zero3.checkpoint`),
with the model's config and tokenizer beside them so that an export needs nothing else.
"""

from __future__ import annotations

import os
import random
import shutil

from aidaptiv_ds.job.failures import TrainingFailed


def resolve_resume(path: str) -> tuple[str, str | None]:
    """(load_dir, tag) for a save dir (tag from its 'latest') or a tag directory inside one."""
    if not os.path.isdir(path):
        raise TrainingFailed(
            f"`resume_from` {path} does not exist: give a `save_dir` of an earlier run or a tag directory inside it"
        )
    if os.path.exists(os.path.join(path, "latest")):
        return path, None
    parent = os.path.dirname(os.path.normpath(path))
    if any(f.endswith("model_states.pt") for f in os.listdir(path)):
        return parent, os.path.basename(os.path.normpath(path))
    raise TrainingFailed(f"`resume_from` {path} holds no DeepSpeed checkpoint (no 'latest' file, no *model_states.pt)")


def rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RunCheckpoints:
    """Resume, save and write out the model of one :class:`~aidaptiv_ds.job.train.Run` (after its build)."""

    def __init__(self, run):
        self.run = run

    def resume(self) -> dict:
        """Restore from ``resume_from`` or ``resume="auto"``; returns the client state (or a fresh one). With
        "auto" the newest checkpoint that verifies is taken, saying which tags it skipped and why."""
        from aidaptiv_ds.job.train_plan import checkpoint_candidates
        from aidaptiv_ds.swap.checkpoint_format import CheckpointDamagedError

        a = self.run.settings
        fresh = {"step": 0, "data_position": 0, "losses": [], "lrs": []}
        if a.resume == "auto":
            candidates = checkpoint_candidates(a.save_dir)
            if not candidates:
                self.run.log(f"`resume` auto: no checkpoint in {a.save_dir} yet, starting from step 0")
                return fresh
            self.run.log(f"`resume` auto: the latest checkpoint in {a.save_dir} is {candidates[0]}")
        elif a.resume_from:
            candidates = [a.resume_from]
        else:
            return fresh
        skipped = []
        for source in candidates:
            try:
                load_dir, tag = resolve_resume(source)
                path, client = self.run.engine.load_checkpoint(
                    load_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
                )
            except (CheckpointDamagedError, TrainingFailed) as e:  # damaged or planted: with auto, the next tag
                if a.resume != "auto":
                    raise
                skipped.append(source)
                self.run.log(f"`resume` auto: skipped {source}: {e}")
                continue
            break
        else:
            raise TrainingFailed(
                f"`resume` auto: no checkpoint in {a.save_dir} verifies ({len(skipped)} skipped, each said why "
                "above): start without `resume`, or restore a good checkpoint"
            )
        if skipped:
            self.run.info["resume_skipped"] = skipped
        if path is None or client is None or "step" not in client:
            raise TrainingFailed(f"`resume_from` {source}: DeepSpeed found no loadable checkpoint there")
        was = {k: client.get(k) for k in ("seq_len", "micro_batch", "world_size")}
        now = {"seq_len": a.seq_len, "micro_batch": self.run.micro_batch, "world_size": self.run.world_size}
        if any(was[k] is not None and was[k] != now[k] for k in now):
            # The data position counts micro-batches of this shape: with another shape the data continues from
            # a different point of the stream than the interrupted run would have.
            self.run.log(
                f"warning: checkpoint was made with {was}, resuming with {now}; "
                "the data order will differ from an uninterrupted run"
            )
        if "rng" in client:
            set_rng_state(client["rng"])
        self.run.info["resumed_from"] = path
        self.run.log(f"resumed {path} at step {client['step']}")
        return client

    def save(self, step: int, position: int, losses: list, save_dir: str | None = None) -> str:
        """Checkpoint tag ``step<N>`` in ``save_dir`` (the run's by default), with what a resume continues from;
        returns its folder."""
        save_dir = save_dir or self.run.settings.save_dir
        tag = f"step{step}"
        client = {
            "step": step,
            "data_position": position,
            "losses": list(losses),
            "rng": rng_state(),
            "lrs": list(getattr(self.run, "lrs", [])),
            "eval_losses": list(getattr(self.run, "eval_losses", [])),
            "aux_losses": list(getattr(self.run, "aux_losses", [])),
            "seed": self.run.settings.seed,
            "seq_len": self.run.settings.seq_len,
            "micro_batch": self.run.micro_batch,
            "world_size": self.run.world_size,
        }
        self.run.engine.save_checkpoint(save_dir, tag=tag, client_state=client)
        folder = os.path.join(save_dir, tag)
        if self.run.rank == 0 and self.run.backend == "aidaptiv":
            # config and tokenizer beside the weights, so that 'aidaptiv-ds export' needs nothing else
            from aidaptiv_ds.job.model_files import save_model_files
            from aidaptiv_ds.swap.checkpoint_format import MODEL_FILES

            save_model_files(
                self.run.spec,
                self.run.tokenizer,
                os.path.join(folder, MODEL_FILES),
                dtype=str(self.run.dtype).replace("torch.", ""),
            )
            if self.run.lora is not None:  # how to read the lora_ parameters (export merges or copies them)
                from aidaptiv_ds.job.lora import save_adapter_config, save_qlora_marker

                save_adapter_config(self.run.engine.module, os.path.join(folder, MODEL_FILES))
                if self.run.lora.bits == 4:
                    save_qlora_marker(os.path.join(folder, MODEL_FILES))
        if save_dir == self.run.settings.save_dir:
            self.run.info.setdefault("saved", []).append(folder)
            if self.run.settings.keep_last:
                self.prune(save_dir, self.run.settings.keep_last)
        return folder

    def prune(self, save_dir: str, keep: int) -> None:
        """Remove all but the newest ``keep`` complete checkpoints of ``save_dir`` (by step number), never the
        one 'latest' names; on each node by its first rank (each node holds its ranks' files of a tag)."""
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        from aidaptiv_ds.job.train_plan import checkpoint_candidates

        latest = (
            os.path.realpath(checkpoint_candidates(save_dir)[0])
            if os.path.isfile(os.path.join(save_dir, "latest"))
            else None
        )
        tags = sorted(
            (int(name[4:]), os.path.join(save_dir, name))
            for name in os.listdir(save_dir)
            if name.startswith("step") and name[4:].isdigit() and os.path.isdir(os.path.join(save_dir, name))
        )
        for _, folder in tags[: max(0, len(tags) - keep)]:
            if os.path.realpath(folder) != latest:
                shutil.rmtree(folder, ignore_errors=True)
                self.run.info.setdefault("pruned", []).append(folder)

    def write_output(self, step: int, position: int, losses: list) -> None:
        """``output_dir``: the model in Hugging Face format, written by rank 0 from the final checkpoint (the
        ``save_dir`` one, or one made in DIR/checkpoint and removed afterwards) through the bounded exporter."""
        import torch.distributed as dist

        from aidaptiv_ds.job.export import export

        out = self.run.settings.output_dir
        final = os.path.join(self.run.settings.save_dir, f"step{step}") if self.run.settings.save_dir else None
        temporary = final is None or not os.path.isdir(final)
        if temporary:
            final = self.save(step, position, losses, save_dir=os.path.join(out, "checkpoint"))
        dist.barrier()  # every rank's folder of the checkpoint is written
        failed = None
        if self.run.rank == 0:
            try:
                summary = export(
                    final, out, merge_lora=self.run.lora is not None and self.run.lora.bits != 4, log=self.run.log
                )
            except (ValueError, OSError) as e:  # reported after the barrier the other ranks wait at
                failed = e
            else:
                if temporary:
                    shutil.rmtree(os.path.join(out, "checkpoint"), ignore_errors=True)
                self.run.info["output_dir"] = out
                self.run.info["output_files"] = summary["files"]
                self.run.log(f"wrote the model in Hugging Face format to {out}")
        dist.barrier()
        if failed is not None:
            raise TrainingFailed(f"`output_dir` {out}: the export of {final} failed: {failed}")
