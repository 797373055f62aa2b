"""The "aidaptiv" block: every problem reported at once, before any file is opened; the translation into
the ZeRO-3 settings DeepSpeed needs."""

import dataclasses
import errno
import os
import types

import pytest

from aidaptiv_ds.config import ds_config as config_ds_config
from aidaptiv_ds.config import resolve as config_resolve
from aidaptiv_ds.config import schema, translate
from aidaptiv_ds.config import settings as config_settings
from aidaptiv_ds.engine import backend as config_backend
from aidaptiv_ds.engine import disk, machine


def ds(block=None, **top):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    cfg.update(top)
    if block is not None:
        cfg["aidaptiv"] = block
    return cfg


def problems(cfg, **kw):
    with pytest.raises(config_ds_config.ConfigError) as e:
        config_resolve.validate(cfg, **kw)
    return e.value.problems


def test_no_block_or_disabled_block_leaves_deepspeed_alone(tmp_path):
    assert config_resolve.validate(ds()) is None
    assert config_resolve.validate(ds({"enabled": False})) is None
    assert not schema.is_enabled(ds({"enabled": False}))


def test_a_good_block_parses(tmp_path):
    cfg = config_resolve.validate(ds({"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "256MiB"}))
    assert (
        cfg.host_budget_bytes == 256 * 2**20
        and cfg.layer_group_size == 4
        and cfg.backend == config_backend.Backend.AUTO
    )


def test_unknown_key_names_the_known_ones(tmp_path):
    p = problems(ds({"enabled": True, "nvme_path": str(tmp_path), "buffer_count": 5}))
    assert len(p) == 1 and "aidaptiv.buffer_count" in p[0] and "host_memory_budget" in p[0]


def test_block_size_takes_a_size_as_the_budget_does(tmp_path):
    block = {"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "256MiB"}
    assert config_resolve.validate(ds(dict(block, block_size="256KiB"))).block_size == 256 * 1024
    assert config_resolve.validate(ds(dict(block, block_size=1 << 20))).block_size == 1 << 20
    assert "a size such as '1MiB'" in problems(ds(dict(block, block_size="big")))[0]
    assert "multiple of 4096" in problems(ds(dict(block, block_size="5000")))[0]  # "5000": bytes, not aligned
    assert "from 4096 to 67108864" in problems(ds(dict(block, block_size="128MiB")))[0]


def test_every_problem_is_reported_together(tmp_path):
    cfg = ds(
        {
            "enabled": True,
            "nvme_path": str(tmp_path / "missing"),
            "block_size": 5000,
            "queue_depth": 0,
            "host_memory_budget": "lots",
            "colour": "red",
        },
        fp16={"enabled": True},
    )
    cfg["zero_optimization"] = {"stage": 2, "offload_param": {"device": "cpu"}}
    p = "\n".join(problems(cfg))
    for expected in (
        "aidaptiv.block_size",
        "aidaptiv.queue_depth",
        "aidaptiv.host_memory_budget",
        "aidaptiv.colour",
        "zero_optimization.stage is 2",
        "offload_param.device is 'cpu'",
        "fp16.enabled",
    ):
        assert expected in p, p


def test_nvme_path_missing_not_a_directory_unwritable_or_too_small(tmp_path, monkeypatch):
    assert "required" in problems(ds({"enabled": True}))[0]
    assert "does not exist" in problems(ds({"enabled": True, "nvme_path": str(tmp_path / "nope")}))[0]
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not a directory" in problems(ds({"enabled": True, "nvme_path": str(f)}))[0]
    # Root passes every permission check, so the refusal is stubbed here: what is checked is the message (the
    # real refusals: tests/unit/test_swap_folders.py).
    monkeypatch.setattr(disk, "probe", _refuse(errno.EACCES))
    msg = problems(ds({"enabled": True, "nvme_path": str(tmp_path)}))[0]
    assert "not writable (EACCES)" in msg and str(tmp_path) in msg
    monkeypatch.undo()
    msg = problems(ds({"enabled": True, "nvme_path": str(tmp_path)}), needed_bytes=1 << 60)[0]
    assert "GiB free but the model state needs" in msg


def _refuse(code):
    def probe(folder, direct=False):
        raise OSError(code, os.strerror(code), folder)

    return probe


def test_a_read_only_mount_is_reported_as_erofs(tmp_path, monkeypatch):
    """Not as EACCES: permissions are not what to fix on a read-only file system."""
    monkeypatch.setattr(disk, "probe", _refuse(errno.EROFS))
    msg = problems(ds({"enabled": True, "nvme_path": str(tmp_path)}))[0]
    assert "read-only file system (EROFS)" in msg and str(tmp_path) in msg and "EACCES" not in msg


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_tmpfs_is_refused():
    import subprocess

    if subprocess.run(["stat", "-f", "-c", "%T", "/dev/shm"], capture_output=True, text=True).stdout.strip() != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    assert "O_DIRECT" in problems(ds({"enabled": True, "nvme_path": "/dev/shm"}))[0]


def test_budget_larger_than_ram_is_refused(tmp_path):
    assert "RAM" in problems(ds({"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": 1 << 60}))[0]


@pytest.mark.parametrize(
    "value,expected",
    [
        (268435456, (268435456, None)),
        (0.25, (None, 0.25)),
        ("25%", (None, 0.25)),
        ("512MiB", (512 * 2**20, None)),
        ("4GB", (4 * 10**9, None)),
        ("1.5GiB", (int(1.5 * 2**30), None)),
    ],
)
def test_budget_forms(value, expected):
    assert schema.parse_budget(value) == expected


@pytest.mark.parametrize("value", [0, -1, 1.5, "0%", "100%", "a lot", True])
def test_bad_budgets(value):
    with pytest.raises(ValueError):
        schema.parse_budget(value)


def test_translation_routes_zero3_through_nvme_and_bounds_deepspeed_by_the_budget(tmp_path):
    cfg = config_resolve.validate(ds({"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "64MiB"}))
    out = translate.to_deepspeed_config(
        ds(
            {"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "64MiB"},
            zero_optimization={"stage": 3, "reduce_bucket_size": 5e8},
        ),
        cfg,
        on_host=False,
    )
    z = out["zero_optimization"]
    assert z["offload_param"]["device"] == "nvme" and z["offload_optimizer"]["device"] == "nvme"
    assert z["offload_param"]["nvme_path"] == str(tmp_path) and z["offload_param"]["max_in_cpu"] == 0
    assert z["stage3_param_persistence_threshold"] == 0
    # A small budget: buckets grow to a quarter of it (an eighth would make many small collectives).
    assert z["reduce_bucket_size"] == 64 * 2**20 // 4 // 4
    assert z["stage3_max_live_parameters"] == 64 * 2**20 // 4 // 4 and z["stage3_max_reuse_distance"] == 0
    big = config_resolve.validate(
        ds({"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "8GiB"}), check_paths=False
    )
    zb = translate.to_deepspeed_config(ds({"enabled": True, "nvme_path": str(tmp_path)}), big, on_host=False)[
        "zero_optimization"
    ]
    assert zb["reduce_bucket_size"] == 8 * 2**30 // 8 // 4 and zb["stage3_max_live_parameters"] == 8 * 2**30 // 16
    # On the CPU the bucket's buffer is host memory too: a 32nd of the budget, 2M elements for small budgets.
    zh = translate.to_deepspeed_config(ds({"enabled": True, "nvme_path": str(tmp_path)}), big, on_host=True)[
        "zero_optimization"
    ]
    assert zh["reduce_bucket_size"] == 8 * 2**30 // 32 // 4
    zs = translate.to_deepspeed_config(ds({"enabled": True, "nvme_path": str(tmp_path)}), cfg, on_host=True)[
        "zero_optimization"
    ]
    assert zs["reduce_bucket_size"] == 1 << 21
    # Without on_host the translation asks DeepSpeed's accelerator (the CPU here).
    assert (
        translate.to_deepspeed_config(ds({"enabled": True, "nvme_path": str(tmp_path)}), big)["zero_optimization"][
            "reduce_bucket_size"
        ]
        == (zb if translate.training_on_host() is False else zh)["reduce_bucket_size"]
    )
    assert z["sub_group_size"] == cfg.optimizer_chunk_numel
    assert out["aidaptiv"]["enabled"] is True


def test_deepspeed_accepts_the_translated_config(tmp_path):
    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        from helpers import _free_port

        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo")
    block = {"enabled": True, "nvme_path": str(tmp_path)}
    cfg = config_resolve.validate(ds(block))
    parsed = DeepSpeedConfig(translate.to_deepspeed_config(ds(block), cfg))
    assert parsed.zero_config.offload_param.device == "nvme"
    assert parsed._param_dict["aidaptiv"]["nvme_path"] == str(tmp_path)


def test_a_share_of_ram_means_the_cgroup_limit_when_lower(tmp_path):
    proc = tmp_path / "cgroup"
    # v1 memory controller at /a/b with a limit on /a; v2 root without one.
    proc.write_text("4:memory:/a/b\n0::/\n")
    (tmp_path / "memory" / "a" / "b").mkdir(parents=True)
    (tmp_path / "memory" / "a" / "b" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory" / "a" / "memory.limit_in_bytes").write_text(str(3 << 30))
    (tmp_path / "memory.max").write_text("max\n")
    assert machine.cgroup_memory_limit(str(proc), str(tmp_path)) == 3 << 30
    proc.write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text(str(5 << 30))
    assert machine.cgroup_memory_limit(str(proc), str(tmp_path)) == 5 << 30
    proc.write_text("0::/\n")
    assert machine.cgroup_memory_limit(str(proc), str(tmp_path)) is None


def counting(monkeypatch, module, name, returns=None):
    """Replace module.name by a stub that counts its calls (and returns ``returns``), or, with
    returns=..., by a wrapper of the original."""
    original = getattr(module, name)
    calls = []

    def stub(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs) if returns is ... else returns

    monkeypatch.setattr(module, name, stub)
    return calls


def test_a_share_of_ram_reads_the_cgroup_once_per_resolution(tmp_path, monkeypatch):
    reads = counting(monkeypatch, machine, "cgroup_memory_limit", returns=None)
    settings = config_resolve.validate(ds({"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "10%"}))
    assert len(reads) == 1
    assert settings.host_budget_bytes == int(0.1 * machine.total_ram_bytes())
    assert settings.optimizer_chunk_numel == max(
        config_settings.AUTO_CHUNK_MIN, min(config_settings.AUTO_CHUNK_MAX, settings.host_budget_bytes // 512)
    )


def test_a_config_is_validated_and_resolved_once(tmp_path, monkeypatch):
    """zero_init and initialize (train, the HF Trainer) resolve the same dict; a translated dict may come back;
    DeepSpeed's config object reaches the swapper factory: one validation, one reading of the machine."""
    reads = counting(monkeypatch, machine, "cgroup_memory_limit", returns=None)
    validations = counting(monkeypatch, config_resolve, "validate", returns=...)
    cfg = ds({"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "25%"})
    translated, settings = config_resolve.resolve(cfg)
    again, same = config_resolve.resolve(cfg, needed_bytes=1 << 20)
    assert same is settings and again == translated and again is not translated
    assert config_resolve.resolve(translated)[1] is settings
    assert config_resolve.settings_for(types.SimpleNamespace(_param_dict=translated)) is settings
    assert len(validations) == 1 and len(reads) == 1
    # The model, known only on the second call, is still checked against the free space.
    with pytest.raises(config_ds_config.ConfigError, match="GiB free but the model state needs"):
        config_resolve.resolve(cfg, needed_bytes=1 << 60)
    assert len(validations) == 1


def test_prepare_twice_validates_once(tmp_path, monkeypatch):
    from aidaptiv_ds.zero3 import initialize, install

    installs = counting(monkeypatch, install, "install")
    validations = counting(monkeypatch, config_resolve, "validate", returns=...)
    reads = counting(monkeypatch, machine, "cgroup_memory_limit", returns=None)
    cfg = ds({"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "20%"}, bf16={"enabled": True})
    first, settings = initialize.prepare(cfg, None, 1)
    second, same = initialize.prepare(cfg, None, 1)
    assert same is settings and first == second and len(installs) == 2
    assert len(validations) == 1 and len(reads) == 1
    assert first["zero_optimization"]["stage3_max_live_parameters"] == settings.host_budget_bytes // 4 // 2
    assert initialize.prepare(ds(), None, 1) == (ds(), None)


def test_the_translated_block_is_the_resolution_written_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = config_resolve.validate(
        ds({"enabled": True, "nvme_path": ".", "host_memory_budget": "1GB", "backend": "posix"})
    )
    assert settings.nvme_path == str(tmp_path) and settings.backend is config_backend.Backend.POSIX
    block = translate.to_deepspeed_config(ds({"enabled": True, "nvme_path": "."}), settings)["aidaptiv"]
    assert block["host_memory_budget"] == 10**9 and block["nvme_path"] == str(tmp_path)
    assert block["optimizer_chunk_numel"] == settings.optimizer_chunk_numel and block["backend"] == "posix"
    # Resolving the written-out block gives the same settings without reading the machine.
    reads = counting(monkeypatch, machine, "total_ram_bytes", returns=1)
    assert config_settings.SwapSettings.from_block(block) == settings and not reads
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.host_budget_bytes = 1


def test_settings_carry_every_setting_of_the_block():
    names = {f.name for f in dataclasses.fields(config_settings.SwapSettings)}
    assert names == set(schema.AidaptivConfig.model_fields) - {"enabled", "host_memory_budget"} | {
        "host_budget_bytes",
        "block_size_source",
        "queue_depth_source",
    }


def test_a_block_deepspeed_got_without_resolve_is_resolved_once(tmp_path, monkeypatch):
    parses = counting(monkeypatch, schema.AidaptivConfig, "model_validate", returns=...)
    obj = types.SimpleNamespace(
        _param_dict=ds({"enabled": True, "nvme_path": str(tmp_path), "sqpoll": True, "host_memory_budget": 3 << 20})
    )
    first = config_resolve.settings_for(obj)
    assert config_resolve.settings_for(obj) is first and first.sqpoll and first.host_budget_bytes == 3 << 20
    assert len(parses) == 1
    assert config_resolve.settings_for(ds({"enabled": False})) is None and config_resolve.settings_for(ds()) is None


def test_one_error_type_for_every_config_problem(tmp_path):
    from aidaptiv_ds.config import ds_config

    assert config_ds_config.ConfigError is ds_config.ConfigError and issubclass(
        config_ds_config.ConfigError, ValueError
    )
    with pytest.raises(ds_config.ConfigError) as block_error:
        config_resolve.validate(ds({"enabled": True, "nvme_path": str(tmp_path), "queue_depth": 0}))
    with pytest.raises(config_ds_config.ConfigError) as file_error:
        ds_config.load(str(tmp_path / "missing.json"))
    assert type(block_error.value) is type(file_error.value)
    assert file_error.value.problems == [str(file_error.value)]
    two = config_ds_config.ConfigError(["a is wrong", "b is wrong"])
    assert two.problems == ["a is wrong", "b is wrong"] and str(two).splitlines()[1:] == [
        "  - a is wrong",
        "  - b is wrong",
    ]


# ---------------------------------------------------------------- Hugging Face's "auto" configs

HF_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "ds_configs",
    "hf_trainer_zero3_aidaptiv.json",
)


def hf_config(tmp_path, budget="64MiB"):
    """ds_configs/hf_trainer_zero3_aidaptiv.json (HF's documented ZeRO-3 config and our block), swap in
    tmp_path."""
    import json

    with open(HF_CONFIG) as f:
        cfg = json.load(f)
    cfg["aidaptiv"].update(nvme_path=str(tmp_path), host_memory_budget=budget)
    return cfg


def as_trainer_leaves_it_for_zero_init(cfg):
    """What transformers' TrainingArguments does before the model is built under zero.Init: batch,
    clipping, optimizer and precision filled; the model-dependent autos left."""
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.update(
        train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, train_batch_size=2, gradient_clipping=1.0
    )
    cfg["optimizer"]["params"].update(lr=7e-6, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0)
    cfg["scheduler"]["params"].update(warmup_min_lr=0, warmup_max_lr=7e-6)
    cfg["fp16"]["enabled"] = cfg["bf16"]["enabled"] = False
    return cfg


def as_trainer_fills_it(cfg, hidden=256):
    """transformers' trainer_config_finalize: the hidden-size autos and the scheduler's steps."""
    import copy

    cfg = copy.deepcopy(cfg)
    z = cfg["zero_optimization"]
    z.update(
        reduce_bucket_size=hidden * hidden,
        stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
        stage3_param_persistence_threshold=10 * hidden,
    )
    cfg["scheduler"]["params"].update(warmup_num_steps=1, total_num_steps=3)
    return cfg


def test_hf_documented_config_resolves_at_zero_init_with_its_autos(tmp_path):
    """HF builds the model under zero.Init with reduce_bucket_size, the prefetch bucket and the persistence
    threshold still "auto" (this raised TypeError comparing "auto" with an int). The settings we bound get
    our values; the rest DeepSpeed reads as its defaults."""
    cfg = as_trainer_leaves_it_for_zero_init(hf_config(tmp_path))
    translated, settings = config_resolve.resolve(cfg)
    z = translated["zero_optimization"]
    ours = translate.to_deepspeed_config(
        ds({"enabled": True, "nvme_path": str(tmp_path), "host_memory_budget": "64MiB"}), settings
    )["zero_optimization"]
    assert (
        z["reduce_bucket_size"]
        == ours["reduce_bucket_size"]
        == translate.reduce_bucket_cap(64 * 2**20, translate.training_on_host())
    )
    assert z["stage3_param_persistence_threshold"] == 0
    # HF's 1e9 are numbers: capped by the budget as any user's number.
    assert z["stage3_max_live_parameters"] == z["stage3_max_reuse_distance"] == 64 * 2**20 // 4 // 4
    assert z["sub_group_size"] == settings.optimizer_chunk_numel
    assert z["stage3_prefetch_bucket_size"] == "auto"  # not ours to bound; DeepSpeed reads its default
    assert "auto" not in [z[k] for k in translate.BOUNDED]


def test_the_trainers_filled_autos_keep_our_values_and_settings(tmp_path):
    """deepspeed.initialize then gets the same config with HF's numbers for the autos (hidden x hidden,
    10 x hidden): they are not the user's, so they get the values zero.Init had, and the same settings."""
    raw = as_trainer_leaves_it_for_zero_init(hf_config(tmp_path))
    at_init, settings = config_resolve.resolve(raw)
    at_initialize, same = config_resolve.resolve(as_trainer_fills_it(raw))
    assert same is settings
    for key in translate.BOUNDED:
        assert at_initialize["zero_optimization"][key] == at_init["zero_optimization"][key], key
    # A config that was never "auto" keeps the user's numbers, capped by the budget as before.
    user = as_trainer_fills_it(raw)
    user["optimizer"]["type"] = "Adam"
    z = config_resolve.resolve(user)[0]["zero_optimization"]
    assert z["reduce_bucket_size"] == 256 * 256
    # The persistence threshold is never the user's: persistent parameters would hold their group's slot.
    assert z["stage3_param_persistence_threshold"] == 0
    big = as_trainer_fills_it(raw, hidden=8192)
    big["optimizer"]["type"] = "Adam"
    assert config_resolve.resolve(big)[0]["zero_optimization"]["reduce_bucket_size"] == translate.reduce_bucket_cap(
        64 * 2**20, translate.training_on_host()
    )


def test_accelerate_zero_init_copy_and_filled_config_agree(tmp_path):
    """accelerate hands zero.Init a copy with batch 1 and no train_batch_size, and fills the rest (the real
    batch among it) before initialize: the same config for us."""
    cfg = hf_config(tmp_path)
    cfg["fp16"]["enabled"] = cfg["bf16"]["enabled"] = False
    cfg["steps_per_print"] = float("inf")
    init_copy = dict(cfg, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    del init_copy["train_batch_size"]
    at_init, settings = config_resolve.resolve(init_copy)
    filled = as_trainer_fills_it(as_trainer_leaves_it_for_zero_init(cfg), hidden=128)
    at_initialize, same = config_resolve.resolve(filled)
    assert same is settings
    assert (
        at_initialize["zero_optimization"]["reduce_bucket_size"] == at_init["zero_optimization"]["reduce_bucket_size"]
    )
    assert at_initialize["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_without_drops_paths_and_the_sections_they_empty():
    cfg = {"fp16": {"enabled": False}, "optimizer": {"type": "AdamW", "params": {"lr": 1}}, "a": 1}
    assert config_resolve._without(cfg, ["fp16.enabled", "optimizer.params.lr", "missing.x", "a.b"]) == {
        "optimizer": {"type": "AdamW"},
        "a": 1,
    }
    assert cfg["fp16"] == {"enabled": False}  # a copy


def test_auto_precision_is_off_as_deepspeed_reads_it(tmp_path):
    from aidaptiv_ds.config import ds_config

    cfg = hf_config(tmp_path)
    assert ds_config.dtype_name(cfg) == "fp32"
    assert not ds_config.precision_enabled(cfg, "fp16")
    assert config_resolve.validate(cfg) is not None  # fp16 "auto" is not fp16 on
    cfg["bf16"]["enabled"] = True
    assert ds_config.dtype_name(cfg) == "bf16"


def test_deepspeed_accepts_the_hf_config_translated_before_the_trainer_fills_it(tmp_path):
    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        from helpers import _free_port

        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo")
    translated, _ = config_resolve.resolve(as_trainer_leaves_it_for_zero_init(hf_config(tmp_path)))
    parsed = DeepSpeedConfig(translated)
    assert parsed.zero_config.reduce_bucket_size == translated["zero_optimization"]["reduce_bucket_size"]
    assert parsed.zero_config.param_persistence_threshold == 0


def test_our_train_job_still_refuses_auto(tmp_path):
    from aidaptiv_ds.config import ds_config

    with pytest.raises(config_ds_config.ConfigError, match="'auto' at .*reduce_bucket_size.*write numbers"):
        ds_config.check(hf_config(tmp_path), world_size=1)
