"""Drop-in where users already are: the Hugging Face Trainer with its documented ZeRO-3 config ("auto"
values, ds_configs/hf_trainer_zero3_aidaptiv.json), TRL's SFTTrainer with the same config and `accelerate
launch` with a DeepSpeed config file, each started the way users start it and compared with the same run
without the "aidaptiv" block (stock in-memory ZeRO-3, same seed and data); and HF's save_model, which
gathers the weights (stage3_gather_16bit_weights_on_model_save), writes what stock ZeRO-3 writes.

The runs are in hf_dropin_run.py: the micro preset, 3 steps of batch 2 x 64 tokens, fp32, one process. The
host budget (40 MiB) is below the model state (94 MiB), so the state moves through the swap files.

LoRA the same two ways (``--lora``): the user's PEFT model in the HF Trainer, and TRL's SFTTrainer given a
``peft_config``; only the adapters train, the frozen base is never written back, and the losses are those
of the same PEFT run on stock ZeRO-3.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import CONFIGS, REPO, _free_port, child_env, failure_excerpt

HF_CONFIG = os.path.join(CONFIGS, "hf_trainer_zero3_aidaptiv.json")
SCRIPT = os.path.join(REPO, "tests", "integration", "hf_dropin_run.py")
BUDGET = "40MiB"
HIDDEN = 256  # the micro preset's: HF fills reduce_bucket_size with HIDDEN**2, the persistence threshold 10x
# What our translation gives an "auto" reduce_bucket_size under BUDGET on the CPU (aidaptiv_ds.config.
# reduce_bucket_cap): HOST_BUCKET_FLOOR elements, which is below a quarter of the budget.
OUR_BUCKET = 1 << 21


def write_configs(tmp_path, edit=None):
    """(ours, stock): the shipped HF config with its swap space in tmp_path and the small budget, and the
    same config without the block."""
    with open(HF_CONFIG) as f:
        cfg = json.load(f)
    if edit:
        edit(cfg)
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    cfg["aidaptiv"].update(nvme_path=str(swap), host_memory_budget=BUDGET, layer_group_size=1)
    ours, stock = tmp_path / "ours.json", tmp_path / "stock.json"
    ours.write_text(json.dumps(cfg))
    del cfg["aidaptiv"]
    stock.write_text(json.dumps(cfg))
    return str(ours), str(stock)


def run(cmd, cwd, out):
    p = subprocess.run(
        cmd, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert p.returncode == 0, failure_excerpt(p.stdout)
    with open(out) as f:
        return json.load(f)


def deepspeed_launch(tmp_path, mode, config, name, *extra):
    """hf_dropin_run.py MODE under the deepspeed launcher, one process, in its own working directory."""
    cwd = tmp_path / name
    cwd.mkdir()
    out = cwd / "run.json"
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return run(
        [
            deepspeed,
            "--num_accelerators",
            "1",
            "--master_port",
            str(_free_port()),
            SCRIPT,
            mode,
            "--config",
            config,
            "--out",
            str(out),
            "--output_dir",
            str(cwd / "out"),
            *extra,
        ],
        cwd,
        out,
    )


def assert_same_losses(ours, stock, rel=1e-5):
    assert len(ours) == len(stock) == 3
    for a, b in zip(ours, stock):
        assert abs(a - b) <= rel * abs(b), (ours, stock)
    assert ours[-1] != ours[0], "the weights did not change: the comparison would prove nothing"


def assert_swapped(run):
    assert run["swapper"] and run["nvme_read_bytes"] > 0, run


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """HF Trainer, the model built under zero.Init with the config's autos: stock ZeRO-3 and ours, each
    ending with save_model."""
    tmp = tmp_path_factory.mktemp("trainer")
    ours_cfg, stock_cfg = write_configs(tmp)
    stock = deepspeed_launch(tmp, "trainer", stock_cfg, "stock", "--save", str(tmp / "stock_model"))
    ours = deepspeed_launch(tmp, "trainer", ours_cfg, "ours", "--save", str(tmp / "ours_model"))
    return tmp, stock, ours


def test_hf_trainer_with_the_documented_auto_config_trains_like_stock_zero3(trainer_runs):
    """Before the fix this died in zero.Init: TypeError comparing "auto" with an int."""
    _, stock, ours = trainer_runs
    assert_swapped(ours)
    assert_same_losses(ours["losses"], stock["losses"])
    # The autos we bound got our values, at zero.Init and again once the Trainer had filled them in
    # (stock trained with HF's hidden x hidden bucket and 10 x hidden threshold).
    assert (stock["reduce_bucket_size"], stock["persistence_threshold"]) == (HIDDEN * HIDDEN, 10 * HIDDEN)
    assert (ours["reduce_bucket_size"], ours["persistence_threshold"], ours["persistent_params"]) == (OUR_BUCKET, 0, 0)


def test_save_model_writes_the_weights_stock_zero3_writes(trainer_runs):
    from safetensors.torch import load_file

    tmp, _, _ = trainer_runs
    stock = load_file(str(tmp / "stock_model" / "model.safetensors"))
    ours = load_file(str(tmp / "ours_model" / "model.safetensors"))
    assert sorted(ours) == sorted(stock) and len(stock) > 10
    for name, tensor in stock.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert (ours[name] - tensor).abs().max().item() <= 1e-6, name


def test_model_built_before_the_trainer_trains_like_stock_zero3(tmp_path):
    """Built before TrainingArguments, the model is partitioned by deepspeed.initialize, which sees only the
    filled config: HF's hidden x hidden bucket is then a number like a user's (under our cap, kept), and its
    10 x hidden persistence threshold is replaced by 0. With it, DeepSpeed kept the norms (256 elements)
    gathered after every step, their layer groups stayed in use, and the second forward ran out of slots
    (HostBudgetError); stock ZeRO-3 keeps its 5 persistent norms."""
    # Built outside zero.Init the model draws its initial weights differently: its own stock reference.
    ours_cfg, stock_cfg = write_configs(tmp_path)
    stock = deepspeed_launch(tmp_path, "trainer", stock_cfg, "stock", "--model-first")
    ours = deepspeed_launch(tmp_path, "trainer", ours_cfg, "ours", "--model-first")
    assert_swapped(ours)
    assert stock["persistent_params"] == 5
    assert (ours["reduce_bucket_size"], ours["persistence_threshold"], ours["persistent_params"]) == (
        HIDDEN * HIDDEN,
        0,
        0,
    )
    assert_same_losses(ours["losses"], stock["losses"])


def test_trl_sft_trainer_with_the_same_config_trains_like_stock_zero3(tmp_path):
    pytest.importorskip("trl")
    ours_cfg, stock_cfg = write_configs(tmp_path)
    stock = deepspeed_launch(tmp_path, "sft", stock_cfg, "stock")
    ours = deepspeed_launch(tmp_path, "sft", ours_cfg, "ours")
    assert_swapped(ours)
    assert_same_losses(ours["losses"], stock["losses"])


# micro, LoRA r=8 on q_proj and v_proj: 2 layers x 2 targets x (A: 8 x 256 + B: 256 x 8)
LORA_TRAINABLE = 2 * 2 * 2 * 8 * 256


def assert_lora_trained_only_adapters(ours, stock):
    assert_swapped(ours)
    assert_same_losses(ours["losses"], stock["losses"])
    assert ours["trainable_names"] == stock["trainable_names"]
    assert all(".lora_A." in n or ".lora_B." in n for n in ours["trainable_names"]), ours["trainable_names"]
    assert ours["trainable_params"] == stock["trainable_params"] == LORA_TRAINABLE
    # Swap writes from the start of training to the end of each step: at most the adapters and their two Adam
    # moments (fp32: 12 bytes a parameter; twice that for 4 KiB extents). Writing back any layer group of the
    # 18.9 MB frozen base (1 MiB and more each) would exceed it.
    writes = ours["nvme_write_bytes_steps"]
    assert len(writes) == 1 + 3, writes
    steps = [b - a for a, b in zip(writes, writes[1:])]
    assert all(0 <= w <= 2 * 12 * LORA_TRAINABLE for w in steps), steps


def test_peft_model_in_the_hf_trainer_trains_only_adapters_like_stock_zero3(tmp_path):
    """A user's get_peft_model(model) in transformers.Trainer with deepspeed= the config with the block."""
    pytest.importorskip("peft")
    ours_cfg, stock_cfg = write_configs(tmp_path)
    stock = deepspeed_launch(tmp_path, "trainer", stock_cfg, "stock", "--lora")
    ours = deepspeed_launch(tmp_path, "trainer", ours_cfg, "ours", "--lora")
    assert_lora_trained_only_adapters(ours, stock)


@pytest.mark.long("TRL and PEFT each run in the tests above")
def test_trl_sft_trainer_with_a_peft_config_trains_only_adapters_like_stock_zero3(tmp_path):
    """TRL wraps the model with PEFT itself and patches its fused LM head into the base model. Before the fix
    our chunked loss went on the PEFT wrapper, around that head: AttributeError: 'CausalLMOutputWithPast'
    object has no attribute 'log_probs'."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    ours_cfg, stock_cfg = write_configs(tmp_path)
    stock = deepspeed_launch(tmp_path, "sft", stock_cfg, "stock", "--lora")
    ours = deepspeed_launch(tmp_path, "sft", ours_cfg, "ours", "--lora")
    assert_lora_trained_only_adapters(ours, stock)


# accelerate refuses mixed_precision (and the other DeepSpeed settings) beside a deepspeed_config_file: the
# JSON decides, and without one the precision is accelerate's default, fp32.
ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {config}
  zero3_init_flag: true
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 1
main_process_port: {port}
"""


def test_accelerate_launch_with_a_deepspeed_config_file_trains_like_stock_zero3(tmp_path):
    """accelerate fills only lr and weight_decay of a config's optimizer from its DummyOptim (its own docs'
    configs give the betas and eps as numbers), so they are numbers here; every other auto stays."""

    def numeric_betas_eps(cfg):
        cfg["optimizer"]["params"].update(betas=[0.9, 0.999], eps=1e-8)

    ours_cfg, stock_cfg = write_configs(tmp_path, numeric_betas_eps)
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    runs = {}
    for name, config in (("stock", stock_cfg), ("ours", ours_cfg)):
        cwd = tmp_path / name
        cwd.mkdir()
        yaml = cwd / "accelerate.yaml"
        yaml.write_text(ACCELERATE_YAML.format(config=config, port=_free_port()))
        runs[name] = run(
            [accelerate, "launch", "--config_file", str(yaml), SCRIPT, "accelerate", "--out", str(cwd / "run.json")],
            cwd,
            cwd / "run.json",
        )
    assert_swapped(runs["ours"])
    assert runs["ours"]["reduce_bucket_size"] == OUR_BUCKET and runs["ours"]["persistence_threshold"] == 0
    assert_same_losses(runs["ours"]["losses"], runs["stock"]["losses"])
