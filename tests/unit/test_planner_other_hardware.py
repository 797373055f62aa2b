"""`aidaptiv-ds plan` for other hardware than this machine's: nothing is measured here, no rate of this machine is
used, and the rates the plan lacks are asked for by their flags; sizes typed without a unit are refused."""

import json

import pytest

from aidaptiv_ds import cli
from aidaptiv_ds.planner import rates as R

# This 2-core VM's rates, as a probe here caches them: a 70B plan on 8 x 80 GB GPUs used its CPU Adam rate and
# came out "645 s, bound cpu_adam".
VM_CPU = {"cpu_flops": 3e10, "cpu_adam": 4e7}
PROBES = ("probe_nvme", "probe_cpu", "probe_zero3", "probe_framework", "probe_launcher", "probe_gpu")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("AIDAPTIV_DS_CACHE_DIR", raising=False)  # the suite-wide cache (conftest) would win


@pytest.fixture
def probed(monkeypatch):
    """The probes that were called; each one fails the plan (an AssertionError no probe handler catches)."""
    calls = []

    def refuse(name):
        def probe(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} ran for a plan of other hardware")

        return probe

    for name in PROBES:
        monkeypatch.setattr(R, name, refuse(name))
    return calls


def vm_cache():
    """The cache as this VM's earlier plans left it: its CPU in both dtypes, ZeRO-3's work and the software."""
    when = "measured 2025-01-01 00:00 UTC"
    entries = {R.cpu_key(dtype): {**VM_CPU, "when": when} for dtype in ("bf16", "fp32")}
    entries[f"zero3:train-tiny:{R.cpu_key('fp32')}:{R.sys.executable}"] = {"zero3_cpu": 2e7, "when": when}
    entries[f"framework:train-micro:{R.sys.executable}"] = {"framework_host": 1.5e9, "when": when}
    entries[f"launcher:deepspeed:{R.sys.executable}"] = {"launcher_host": 5e8, "when": when}
    R.save_cache(entries)


def plan_json(capsys, *argv):
    rc = cli.main(["plan", *argv, "--json"])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err


LLAMA_70B_ON_8_H100 = [
    "--model",
    "llama2-70b",
    "--seq-len",
    "2048",
    "--micro-batch",
    "1",
    "--gpus",
    "8",
    "--gpu-mem",
    "80GB",
    "--host-mem",
    "2TB",
    "--nvme-free",
    "8TB",
    "--gpu-flops",
    "4e14",
    "--pcie-bw",
    "25GB/s",
]


def test_a_gpu_plan_of_another_machine_probes_nothing(probed, capsys):
    """No --no-probe, an empty cache: a plan for other hardware measured this machine's CPU (71 s on the VM)."""
    rc, out, err = plan_json(capsys, *LLAMA_70B_ON_8_H100)
    assert probed == []
    assert rc == 0
    assert "planning for other hardware (--gpu-mem, --host-mem, --pcie-bw, --gpu-flops)" in err


def test_a_gpu_plan_of_another_machine_uses_no_rate_measured_here(probed, capsys):
    """This VM's cached CPU rates are not the other machine's: they are left out, the offloading backends ask for
    --cpu-adam instead of being bound by the VM's, and ZeRO-3 (no CPU Adam) is predicted from the given rates."""
    vm_cache()
    rc, out, err = plan_json(capsys, *LLAMA_70B_ON_8_H100)
    assert probed == []
    assert {"cpu_flops", "cpu_adam", "zero3_cpu"}.isdisjoint(out["rates"])
    assert out["rates"]["gpu_flops"]["source"] == "given"
    # the software's own memory is this installation's wherever it runs: still read from the cache
    assert out["rates"]["framework_host"]["value"] == 1.5e9
    offloading = [b for name, b in out["backends"].items() if b["fits"] and name != "zero3"]
    assert offloading, "a 70B model on 8 x 80 GB fits some offloading backend"
    for b in out["backends"].values():
        assert b["prediction"]["bound"] != "cpu_adam"
        assert any(n.startswith("planned for other hardware (--gpu-mem,") for n in b["notes"]), b["notes"]
    for b in offloading:
        assert b["prediction"]["step_s"] is None and "cpu_adam" in b["prediction"]["missing_rates"]
        note = next(n for n in b["notes"] if n.startswith("planned for other hardware"))
        assert "no rate of this machine's hardware is measured or used" in note and "--cpu-adam" in note, note
    # with the other machine's rates given, the step time comes from them
    rates = ["--cpu-adam", "2e9", "--nvme-read-bw", "12GB/s", "--nvme-write-bw", "8GB/s"]
    rc, out, _ = plan_json(capsys, *LLAMA_70B_ON_8_H100, *rates)
    aidaptiv = out["backends"]["aidaptiv"]
    assert out["rates"]["cpu_adam"]["source"] == "given" and aidaptiv["prediction"]["step_s"] is not None
    assert "give the other machine's" not in " ".join(aidaptiv["notes"])


@pytest.mark.parametrize(
    "hardware, why",
    [
        (["--host-mem", "64GB"], "--host-mem"),
        (["--nodes", "2"], "--nodes 2"),
        (["--cpu-flops", "1e12"], "--cpu-flops"),
    ],
)
def test_a_cpu_plan_of_another_machine_asks_for_its_cpu_rates(probed, capsys, hardware, why):
    vm_cache()
    rc, out, err = plan_json(capsys, "--model", "tiny", "--seq-len", "64", "--micro-batch", "1", *hardware)
    assert probed == [] and rc == 0
    assert "cpu_adam" not in out["rates"]
    zero3 = out["backends"]["zero3"]
    assert zero3["fits"] and zero3["prediction"]["bound"] is None
    note = next(n for n in zero3["notes"] if n.startswith("planned for other hardware"))
    assert f"({why})" in note and "give the other machine's" in note and "--cpu-adam" in note, note


def test_gpus_beyond_this_machines_are_another_machine(probed, monkeypatch, capsys):
    """One GPU here, a plan of eight: the GPU is not probed (its rates would be one GPU's of this machine)."""
    monkeypatch.setattr("aidaptiv_ds.engine.machine.cuda_memory_bytes", lambda: 80 << 30)
    monkeypatch.setattr("aidaptiv_ds.engine.machine.cuda_device_count", lambda: 1, raising=False)
    rc, out, err = plan_json(capsys, "--model", "tiny", "--seq-len", "64", "--micro-batch", "1", "--gpus", "8")
    assert probed == []
    assert out["hardware"]["device"] == "cuda" and out["rates"] == {}
    assert any("(--gpus 8, more than this machine's 1)" in n for n in out["backends"]["zero3"]["notes"])


def test_a_plan_of_this_machine_still_measures_it(monkeypatch, capsys):
    monkeypatch.setattr(R, "probe_cpu", lambda dtype: dict(VM_CPU))
    monkeypatch.setattr(R, "probe_zero3", lambda flops, adam: {"zero3_cpu": 2e7})
    monkeypatch.setattr(R, "probe_framework", lambda: {"framework_host": 1.5e9})
    monkeypatch.setattr(R, "probe_launcher", lambda: {"launcher_host": 5e8})
    monkeypatch.setattr("aidaptiv_ds.engine.machine.cuda_memory_bytes", lambda: None)
    rc, out, err = plan_json(capsys, "--model", "tiny", "--seq-len", "64", "--micro-batch", "1")
    assert out["rates"]["cpu_adam"]["value"] == VM_CPU["cpu_adam"] and "measured" in out["rates"]["cpu_adam"]["source"]
    assert "other hardware" not in err
    assert not any("other hardware" in n for b in out["backends"].values() for n in b["notes"])


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
