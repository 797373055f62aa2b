"""The training job's new options without DeepSpeed: step count from --epochs, evaluation steps, --resume auto,
the checks of every option at once (numbers, and every place the run writes, tried on disk), the lr schedules
(and their state across a save and load), the held-out split and its batches, the held-out loss, and records
rendered through a tokenizer's chat template."""

import argparse
import math
import os
import subprocess
import sys

import pytest
import torch

from aidaptiv_ds.commands.flags import as_flags
from aidaptiv_ds.job import data as D
from aidaptiv_ds.job import lr_schedule, train_plan
from aidaptiv_ds.job.evaluation import evaluate


def said(args):
    """The problems as ``aidaptiv-ds train`` says them (each backquoted setting as its flag)."""
    return [as_flags(p) for p in train_plan.problems(args)]


def parse(*argv):
    from aidaptiv_ds.cli import parse_args

    return parse_args(["train", "--config", "c.json", *argv])


def test_steps_from_epochs_and_steps():
    assert train_plan.total_steps(None, None, 1000, 100) == 10
    assert train_plan.total_steps(7, None, 1000, 100) == 7
    assert train_plan.total_steps(None, 2, 1000, 300) == math.ceil(2000 / 300) == 7
    assert train_plan.total_steps(5, 2, 1000, 300) == 5  # whichever ends first
    assert train_plan.total_steps(None, 0.01, 1000, 300) == 1


def test_eval_steps():
    assert [s for s in range(1, 8) if train_plan.eval_due(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if train_plan.eval_due(s, 0, 7)] == [7]


def test_every_problem_at_once():
    a = parse(
        "--steps",
        "0",
        "--epochs",
        "-1",
        "--eval-fraction",
        "0.2",
        "--eval-data",
        "e.jsonl",
        "--resume",
        "auto",
        "--resume-from",
        "ck",
        "--warmup-steps",
        "3",
    )
    found = said(a)
    assert len(found) == 6, found
    assert any("--resume auto and --resume-from" in p for p in found)
    assert any("--warmup-steps needs --lr-schedule" in p for p in found)
    assert said(parse("--eval-every", "2")) == [
        "--eval-every needs held-out data: give --eval-fraction F or --eval-data FILE"
    ]
    assert said(parse("--resume", "auto")) == [
        "--resume auto looks for the latest checkpoint in --save-dir: give --save-dir"
    ]
    assert (
        said(
            parse(
                "--epochs",
                "2",
                "--eval-fraction",
                "0.1",
                "--eval-every",
                "5",
                "--lr-schedule",
                "cosine",
                "--warmup-steps",
                "3",
            )
        )
        == []
    )
    assert lr_schedule.problems("linear", 10, 10) and not lr_schedule.problems("constant", 10, 10)


def test_numbers_that_failed_mid_run_or_trained_nonsense_are_refused_at_once():
    """--micro-batch 0 (once a KeyError in the job), --grad-accum 0 (a ZeroDivisionError) and an lr of nan, inf or
    -1 (which ran and said status=ok) are each one sentence, said together before anything starts."""
    found = said(
        parse("--micro-batch", "0", "--grad-accum", "0", "--lr", "nan", "--seq-len", "0", "--save-every", "-1")
    )
    assert found == [
        "--seq-len 0 must be at least 1",
        "--micro-batch 0 must be at least 1 (sequences per rank per micro-step)",
        "--grad-accum 0 must be at least 1 (micro-steps per optimizer step)",
        "--lr nan must be a finite number, 0 or more (e.g. 1e-5)",
        "--save-every -1 must not be negative",
    ]
    for lr in ("inf", "-inf", "-1"):
        assert said(parse(f"--lr={lr}")) == [f"--lr {float(lr)} must be a finite number, 0 or more (e.g. 1e-5)"]
    assert said(parse("--lr", "0", "--micro-batch", "1", "--grad-accum", "1", "--warmup", "0")) == []
    for timeout in ("0", "-5", "nan"):
        assert said(parse("--peer-timeout", timeout)) == [
            f"--peer-timeout {float(timeout)} must be a positive number of seconds"
        ]


def _writes(**where):
    places = {"save_dir": None, "output_dir": None, "metrics_out": None, "logits_out": None}
    return [as_flags(p) for p in train_plan.output_problems(argparse.Namespace(**{**places, **where}))]


def test_every_place_the_run_writes_is_tried_before_it_starts_and_nothing_is_left(tmp_path):
    """A file where a folder is expected, a folder to be made under a regular file, a folder where a file is
    expected: one sentence each, naming the flag, all at once. Folders and files that do not exist yet pass where
    their nearest existing parent takes a file; the check makes nothing and leaves nothing behind."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    (tmp_path / "folder").mkdir()
    assert _writes(
        save_dir=str(blocker),
        output_dir=str(blocker / "model"),
        metrics_out=str(tmp_path / "folder"),
        logits_out=str(blocker / "logits.pt"),
    ) == [
        f"--save-dir {blocker} is a file, not a folder: give a folder (it is made when missing)",
        f"--output-dir {blocker}/model cannot be made because {blocker} is a file, not a folder: give a path "
        "under a folder",
        f"--metrics-out {tmp_path}/folder is a folder: give a file name",
        f"--logits-out {blocker}/logits.pt cannot be written because {blocker} is a file, not a folder: give a "
        "path under a folder",
    ]
    before = sorted(os.listdir(tmp_path))
    assert (
        _writes(
            save_dir=str(tmp_path / "new" / "ckpt"),
            output_dir=str(tmp_path / "folder"),
            metrics_out=str(tmp_path / "new" / "m.json"),
            logits_out=str(tmp_path / "logits.pt"),
        )
        == []
    )
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "folder") == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root passes permission bits: the read-only mount test covers root")
def test_a_folder_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        found = _writes(save_dir=str(locked / "ckpt"), output_dir=str(locked), metrics_out=str(locked / "m.json"))
    finally:
        locked.chmod(0o700)
    assert len(found) == 3 and all("is not writable (EACCES)" in p and str(locked) in p for p in found), found


def test_a_read_only_mount_is_refused_even_to_root(tmp_path):
    """EROFS, what refuses root as well (root passes every permission bit, and os.access says yes to it): the
    check runs in a mount namespace of its own with a folder bind-mounted read-only. Skipped where the kernel or
    sandbox refuses user and mount namespaces; the test above and the one of a path through a file still run."""
    from helpers import REPO, read_only_mount

    locked = tmp_path / "locked"
    locked.mkdir()
    wrap = read_only_mount(locked)
    if not wrap:
        pytest.skip("no user and mount namespace this Python runs in here: EROFS cannot be made without privilege")
    code = (
        "import argparse, sys\n"
        "from aidaptiv_ds.commands.flags import as_flags\n"
        "from aidaptiv_ds.job.train_plan import output_problems\n"
        "d = sys.argv[1]\n"
        "ns = argparse.Namespace(save_dir=d + '/ckpt', output_dir=d, metrics_out=d + '/m.json', logits_out=None)\n"
        "print('\\n'.join(as_flags(p) for p in output_problems(ns)))\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([*wrap, sys.executable, "-c", code, str(locked)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    erofs = "is on a read-only file system (EROFS): remount it read-write or choose a folder on a writable disk"
    assert out.stdout.splitlines() == [
        f"--save-dir {locked}/ckpt would be made in {locked}, which {erofs}",
        f"--output-dir {locked} {erofs}",
        f"--metrics-out {locked}/m.json cannot be written: its folder {locked} {erofs}",
    ]
    assert os.listdir(locked) == []


def test_latest_checkpoint(tmp_path):
    assert train_plan.latest_checkpoint(str(tmp_path / "nothing")) is None
    assert train_plan.latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest").write_text("step4")
    with pytest.raises(ValueError, match="names the checkpoint 'step4'"):
        train_plan.latest_checkpoint(str(tmp_path))
    (tmp_path / "step4").mkdir()
    assert train_plan.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step4")


def _lrs(schedule, warmup, total, steps, state=None):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = lr_schedule.scheduler_factory(schedule, warmup, total)(opt)
    if state is not None:
        opt.load_state_dict(state[0])
        sched.load_state_dict(state[1])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out, (opt.state_dict(), sched.state_dict())


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedules_warm_up_then_follow_their_curve_and_survive_a_save(schedule):
    lrs, _ = _lrs(schedule, 3, 10, 10)
    assert lrs[:4] == pytest.approx([0.0, 0.5 / 3, 1.0 / 3, 0.5])
    after = lrs[3:]
    if schedule == "constant":
        assert after == [0.5] * 7
    else:
        assert all(a > b for a, b in zip(after, after[1:])) and after[-1] < 0.1
    if schedule == "cosine":
        assert lrs[3 + 7 // 2] == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    first, state = _lrs(schedule, 3, 10, 4)
    rest, _ = _lrs(schedule, 3, 10, 6, state=state)  # a new optimizer and scheduler, loaded: as a resume
    assert first + rest == lrs


def test_held_out_split_is_seeded_and_disjoint():
    records = [("w", {"prompt": str(i), "response": "r"}) for i in range(40)]
    train, held = D.split_held_out(records, 0.1, seed=1)
    assert len(held) == 4 and len(train) == 36 and not {id(r) for r in train} & {id(r) for r in held}
    assert D.split_held_out(records, 0.1, seed=1) == (train, held)
    assert D.split_held_out(records, 0.1, seed=2)[1] != held
    assert D.split_held_out(records, 0.0, seed=1) == (records, [])
    assert len(D.split_held_out(records[:3], 0.01, seed=1)[1]) == 1  # at least one record
    with pytest.raises(D.DataError, match="leaves nothing to train on"):
        D.split_held_out(records[:1], 0.5, seed=1)


def test_eval_batches_cover_each_sequence_once_over_ranks():
    docs = [list(range(i * 10, i * 10 + 9)) for i in range(7)]  # 63 tokens: 7 sequences of 8, tail of 7 left out
    ranks = [D.EvalBatches(docs, 8, 2, r, 3) for r in range(3)]
    assert ranks[0].sequences == 7 and ranks[0].rounds == 2  # 4 global batches over 3 ranks
    seen = []
    for b in ranks:
        for i in range(b.rounds):
            batch, weight = b.batch(i)
            seen += batch["input_ids"][:weight].tolist()
    flat = [t for d in docs for t in d][:56]
    assert sorted(map(tuple, seen)) == sorted(tuple(flat[k * 8 : (k + 1) * 8]) for k in range(7))
    assert ranks[1].batch(1)[1] == 0 and ranks[2].batch(1)[1] == 0  # stand-ins of the last round
    with pytest.raises(D.DataError, match="fewer than one sequence"):
        D.EvalBatches([[1, 2, 3]], 8, 1, 0, 1, what="--eval-data e.jsonl")


class _MeanLossModel(torch.nn.Module):
    """A model whose loss is the mean of its input ids: the held-out loss is then the mean token id."""

    device = torch.device("cpu")

    def forward(self, input_ids, labels):
        return argparse.Namespace(loss=input_ids.float().mean())


def test_held_out_loss_is_the_mean_over_tokens_and_training_mode_returns():
    docs = [list(range(i * 8, i * 8 + 8)) for i in range(5)]
    model = _MeanLossModel()
    model.train()
    loss = evaluate(model, D.EvalBatches(docs, 8, 2, 0, 1))  # batches of 2, 2 and 1 sequences
    assert loss == pytest.approx(sum(range(40)) / 40) and model.training


CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_records_go_through_the_tokenizers_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from aidaptiv_ds.models.tokenizer import ByteTokenizer, HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(set("abcdefghijklmnopqrstuvwxyz:.ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")) + [" ", "\n"]:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp_path / "with")
    fast.chat_template = None
    fast.save_pretrained(tmp_path / "without")

    rec = {"instruction": "Add.", "input": "2 and 3", "output": "5"}
    assert D.record_messages(rec) == [
        {"role": "user", "content": "Add.\n\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    with_template = HFTokenizer(str(tmp_path / "with"))
    assert with_template.has_chat_template
    ids = D.record_tokens(rec, with_template)
    assert ids[-1] == with_template.eos_token_id
    rendered = fast.convert_tokens_to_string(fast.convert_ids_to_tokens(ids[:-1]))
    assert rendered.replace(" ", "") == "<s>user:Add.\n\n2and3\n<s>assistant:5\n".replace(" ", "")
    without = HFTokenizer(str(tmp_path / "without"))
    assert not without.has_chat_template
    assert D.record_tokens(rec, without) == without.encode(D.format_record(rec))
    assert D.record_tokens(rec, ByteTokenizer()) == ByteTokenizer().encode(D.format_record(rec))
