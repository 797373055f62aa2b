import subprocess
import sys

import pytest

from aidaptiv_ds import cli


def parse(argv):
    return cli.parse_args(argv)


def test_train_defaults_and_options():
    a = parse(["train", "--config", "c.json"])
    assert a._module.__name__ == "aidaptiv_ds.commands.train"
    # --steps is None unless given, so that --epochs can tell; without --epochs the run makes 10 steps.
    from aidaptiv_ds.job.train_plan import total_steps

    assert (a.model, a.steps, a.seq_len, a.seed, a.warmup, a.save_every) == ("tiny", None, 512, 1234, 2, 0)
    assert total_steps(a.steps, a.epochs, epoch_tokens=1000, tokens_per_step=10) == 10
    assert a.micro_batch is None and a.grad_accum is None and a.lr is None and a.dtype is None
    a = parse(
        [
            "train",
            "--config",
            "c.json",
            "--model",
            "micro",
            "--steps",
            "3",
            "--seq-len",
            "64",
            "--micro-batch",
            "4",
            "--grad-accum",
            "2",
            "--lr",
            "1e-5",
            "--dtype",
            "bf16",
            "--nvme-path",
            "/s",
            "--metrics-out",
            "m.json",
            "--save-dir",
            "ck",
            "--save-every",
            "2",
            "--resume-from",
            "ck",
            "--gpu-mem-cap-gb",
            "20",
            "--warmup",
            "1",
        ]
    )
    assert (a.micro_batch, a.grad_accum, a.lr, a.dtype, a.gpu_mem_cap_gb) == (4, 2, 1e-5, "bf16", 20.0)


def test_config_is_required_and_dtype_is_checked(capsys):
    with pytest.raises(SystemExit):
        parse(["train"])
    with pytest.raises(SystemExit):
        parse(["train", "--config", "c.json", "--dtype", "int8"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--local_rank=1", "train", "--config", "c.json"],  # where the deepspeed launcher puts it
        ["train", "--config", "c.json", "--local_rank=1"],
        ["train", "--local-rank", "0", "--config", "c.json"],
    ],
)
def test_local_rank_is_accepted_silently(argv):
    assert parse(argv).config == "c.json"


def test_help_of_the_module_entry_point():
    p = subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", "train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0
    assert "--metrics-out" in p.stdout and "llama3.1-70b" in p.stdout and "--local_rank" not in p.stdout


def test_only_the_chosen_subcommand_is_imported(monkeypatch):
    # Ranks started by the deepspeed launcher run `python -m aidaptiv_ds train`; a broken or missing module
    # of another subcommand must not stop them.
    monkeypatch.setitem(cli.SUBCOMMANDS, "nothing", ("aidaptiv_ds.no_such_module", "a missing command"))
    assert cli.parse_args(["train", "--config", "c.json"]).config == "c.json"
    with pytest.raises(ModuleNotFoundError):
        cli.parse_args(["nothing"])


def test_train_help_is_grouped_with_a_short_description():
    help_text = cli.build_parser("train").format_help()
    for heading in ("model and data:", "schedule:", "memory and swap:", "checkpoints:", "output:"):
        assert heading in help_text, heading
    # Each flag sits in its group: the order of the headings and of a flag of each.
    groups = help_text.split("options:", 1)[1]
    order = [
        groups.index(s)
        for s in (
            "model and data:",
            "--lora",
            "schedule:",
            "--epochs",
            "memory and swap:",
            "--host-budget",
            "checkpoints:",
            "--resume {auto}",
            "output:",
            "--metrics-out",
        )
    ]
    assert order == sorted(order)
    description = cli.build_parser("train").description
    assert len(description.splitlines()) < 8 and "exit status: 0 ok, 1 error, 3" in help_text
    assert "docs/USAGE.md" in help_text


def test_every_subcommand_has_a_short_description():
    for command in cli.SUBCOMMANDS:
        description = cli.build_parser(command).description
        assert 0 < len(description.splitlines()) < 12, (command, description)


def test_autoload_switched_off_imports_nothing_of_ours_at_start_up():
    """AIDAPTIV_DS_AUTOLOAD=0 is decided in the start-up hook's .pth line itself: no import of the package (it
    cost every Python start 7-8 ms) when the hook is off; on, the package is imported at start-up."""
    import os

    code = "import sys; print('aidaptiv_ds' in sys.modules)"
    for value, imported in (("0", "False"), ("1", "True")):
        env = dict(os.environ, AIDAPTIV_DS_AUTOLOAD=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == imported, (value, out.stdout, out.stderr[-500:])
