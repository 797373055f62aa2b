"""One vocabulary for the commands' shared flags (aidaptiv_ds/commands/flags.py): every command that takes one
spells, parses and shows it the same way, the old spellings still work for one release, and nothing below the
commands imports argparse or names a flag."""

import argparse
import pathlib
import re
import subprocess
import sys

import pytest

from aidaptiv_ds import cli
from aidaptiv_ds.commands import flags

REPO = pathlib.Path(__file__).resolve().parents[2]


def actions(command):
    return cli.build_parser(command)._actions


def test_every_shared_flag_is_defined_through_flags_py_in_every_command():
    names = {f.name: f for f in flags.SHARED}
    seen = {}
    for command in cli.SUBCOMMANDS:
        for action in actions(command):
            shared = [o for o in action.option_strings if o in names]
            if not shared:
                assert not set(action.option_strings) & set(flags.DEPRECATED), (command, action.option_strings)
                continue
            flag = getattr(action, "shared_flag", None)
            assert flag is names[shared[0]], f"{command} defines {shared[0]} itself: use flags.add"
            assert action.option_strings == [flag.name, *action.deprecated_aliases], (command, action.option_strings)
            assert all(flags.DEPRECATED[a] == flag.name for a in action.deprecated_aliases)
            assert action.dest == flag.dest
            assert action.type is flag.parse, (command, flag.name)
            if flag.metavar:
                assert action.metavar == flag.metavar, (command, flag.name)
            if flag.choices:
                assert set(flag.choices) <= set(action.choices), (command, flag.name)
            seen.setdefault(flag.name, []).append(command)
    # the flags the issue names are shared where the commands have them
    assert {"train", "plan", "generate"} <= set(seen["--host-budget"])
    assert {"train", "plan", "generate", "io-bench", "env"} <= set(seen["--nvme-path"])
    assert {"train", "plan", "generate"} <= set(seen["--dtype"])


@pytest.mark.parametrize(
    "command,required",
    [
        ("train", ["--config", "c.json"]),
        ("plan", ["--model", "micro", "--seq-len", "8", "--micro-batch", "1"]),
        ("generate", ["--model", "m"]),
    ],
)
def test_the_same_values_parse_the_same_way_in_each_command(command, required):
    for given, wanted in (
        ("25%", "25%"),
        ("64GiB/node", "64GiB/node"),
        ("512MiB", "512MiB"),
        ("16GiB/rank", "16GiB/rank"),
    ):
        assert cli.parse_args([command, *required, "--host-budget", given]).host_budget == wanted
    for given, wanted in (("bf16", "bf16"), ("bfloat16", "bf16"), ("float32", "fp32"), ("FP16", "fp16")):
        assert cli.parse_args([command, *required, "--dtype", given]).dtype == wanted
    assert cli.parse_args([command, *required, "--nvme-path", "/x"]).nvme_path in ("/x", ["/x"])


@pytest.mark.parametrize("command", ["train", "plan", "generate"])
@pytest.mark.parametrize("bad", ["25", "lots", "64GiB/rack", "25%/rank"])
def test_a_bad_host_budget_is_refused_by_argparse_in_each_command(command, bad, capsys):
    if bad == "25":  # a bare number is bytes, as in the block: accepted
        return
    with pytest.raises(SystemExit) as e:
        cli.parse_args([command, "--host-budget", bad])
    assert e.value.code == 2 and "--host-budget" in capsys.readouterr().err


def test_old_spellings_still_work_and_say_their_new_name(capsys):
    a = cli.parse_args(["plan", "--model", "micro", "--seq-len", "8", "--micro-batch", "1", "--nvme", "/a", "/b"])
    assert a.nvme_path == ["/a", "/b"]
    assert "--nvme is now --nvme-path" in capsys.readouterr().err
    assert cli.parse_args(["io-bench", "--dir", "/d"]).nvme_path == "/d"
    assert "--dir is now --nvme-path" in capsys.readouterr().err
    assert cli.parse_args(["generate", "--model", "m", "--dtype", "bfloat16"]).dtype == "bf16"
    assert cli.parse_args(["generate", "--model", "m"]).dtype == "auto"


def test_library_errors_are_said_as_flags():
    text = "`save_dir` /x is read-only: give another `save_dir`; `nvme_path` too; `x_y` untouched"
    assert flags.as_flags(text, {"save_dir", "nvme_path"}) == (
        "--save-dir /x is read-only: give another --save-dir; --nvme-path too; `x_y` untouched"
    )
    assert flags.as_flags("`seq_len` 0") == "--seq-len 0"


def test_nothing_below_the_commands_imports_argparse_or_names_a_flag_of_its_own_command():
    package = REPO / "aidaptiv_ds"
    for path in package.rglob("*.py"):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("commands/") or rel == "cli.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(import argparse|from argparse)", text, re.M), rel
    # The library's own API errors name parameters, not flags (these once said --dtype, --dir, --host-budget).
    for rel in (
        "inference/generate.py",
        "inference/streamed.py",
        "inference/weight_groups.py",
        "inference/weight_layout.py",
        "inference/weight_plan.py",
        "engine/disk.py",
        "job/train.py",
        "job/checkpoints.py",
        "job/train_plan.py",
        "job/lr_schedule.py",
    ):
        text = (package / rel).read_text(encoding="utf-8")
        raised = re.findall(r"(?:raise \w+\(|\.append\()\s*f?[\"']([^\"']*)", text)
        assert not [r for r in raised if re.search(r"(?<![\w-])--[a-z]", r)], (rel, raised)


def test_the_manuals_table_is_made_from_the_code():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "flag_table.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_argparse_type_errors_name_the_value():
    with pytest.raises(argparse.ArgumentTypeError, match="not a number of GB"):
        flags.parse_gigabytes("many")
    with pytest.raises(argparse.ArgumentTypeError, match="outside 0"):
        flags.parse_seed("-1")
