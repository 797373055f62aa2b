"""`aidaptiv-ds plan` for other hardware than this machine's: nothing is measured here, no rate of this machine is
used, and the rates the plan lacks are asked for by their flags; sizes typed without a unit are refused."""

import json

import pytest

from aidaptiv_ds import cli

PLAN = ["plan", "--model", "tiny", "--seq-len", "8", "--micro-batch", "1", "--no-probe"]


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--gpu-mem", "40"),
        ("--host-mem", "512"),
        ("--nvme-free", "2000"),
        ("--framework-mem", "3"),
        ("--launcher-mem", "1.5"),
        ("--gpu-overhead", "1"),
    ],
)
def test_a_size_without_a_unit_below_a_mebibyte_is_refused(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        cli.main([*PLAN, flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {value} has no unit, so it means {value} bytes: write {value}GB" in err, err


def test_the_gpu_mem_refusal_is_one_sentence(capsys):
    with pytest.raises(SystemExit):
        cli.main([*PLAN, "--gpu-mem", "40"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith(
        "--gpu-mem 40 has no unit, so it means 40 bytes: write 40GB (or 40GiB), or bytes of at least 1048576"
    ), line


@pytest.mark.parametrize(
    "flag, value", [("--pcie-bw", "12"), ("--nvme-read-bw", "6"), ("--host-budget", "16"), ("--host-budget", "16/node")]
)
def test_bandwidths_and_the_host_budget_follow_the_same_rule(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        cli.main([*PLAN, flag, value])
    assert e.value.code == 2 and f"{flag} {value} has no unit" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "generate"])
def test_every_command_refuses_a_host_budget_without_a_unit(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.parse_args([command, "--host-budget", "16"])
    assert e.value.code == 2 and "--host-budget 16 has no unit" in capsys.readouterr().err


def test_bytes_written_out_zero_and_units_are_taken(capsys):
    rc = cli.main([*PLAN, "--gpu-mem", "42949672960", "--nvme-free", "0", "--host-budget", "2147483648", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc in (0, 3)
    assert out["hardware"]["gpu_mem_bytes"] == 42949672960 and out["hardware"]["nvme_free_bytes"] == 0
    from aidaptiv_ds.config import schema

    # In the "aidaptiv" block a bare number stays bytes, as everywhere in a DeepSpeed config.
    assert schema.parse_host_budget(16) == (16, None, "rank")
