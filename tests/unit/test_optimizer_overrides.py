"""AidaptivZeroOptimizer's overrides of DeepSpeed's ZeRO-3 internals: they exist there (a rename in a DeepSpeed
release must show here), and on one rank the reduce-scatter it skips gives exactly what DeepSpeed's would."""

import subprocess
import sys

import pytest
from helpers import child_env


@pytest.mark.parametrize("name", ["_constant_buffered_norm2", "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"])
def test_the_methods_we_override_are_deepspeeds(name):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from aidaptiv_ds.zero3.optimizer import AidaptivZeroOptimizer

    assert name in vars(DeepSpeedZeroOptimizer_Stage3)
    assert name in vars(AidaptivZeroOptimizer)


# One gloo rank; DeepSpeed's method and ours called on the same stand-in optimizer and gradients.
ONE_RANK = r"""
import os, types, torch, deepspeed
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
deepspeed.init_distributed(dist_backend="gloo")
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Base
from aidaptiv_ds.zero3.optimizer import AidaptivZeroOptimizer as Ours
NAME = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
torch.manual_seed(0)
for predivide, acc_dtype in ((1.0, torch.float32), (3.0, torch.float32), (1.0, torch.float64)):
    params = []
    for n in (7, 4096, 1000):
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.randn(n)
        params.append(p)
    fake = types.SimpleNamespace(
        _aidaptiv=object(), all2all_process_group=None, dtype=torch.float32, postscale_gradients=True,
        gradient_predivide_factor=predivide, gradient_accumulation_dtype=acc_dtype,
        _get_param_partition_group=lambda p: None, _assert_same_partition_group=lambda ps: None,
        _gradient_averaging_world_size=lambda ps, w: w)
    grads = [p.grad.clone() for p in params]
    theirs = [t.clone() for t in getattr(Base, NAME)(fake, params, torch.float32)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    ours = getattr(Ours, NAME)(fake, params, torch.float32)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (predivide, acc_dtype)
print("same")
"""


def test_one_rank_gradients_are_handed_over_unchanged(tmp_path):
    from helpers import _free_port

    r = subprocess.run(
        [sys.executable, "-c", ONE_RANK],
        env=child_env(PORT=str(_free_port())),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("same"), r.stderr[-3000:]


# One rank on the CPU: ZeRO-3's contiguous reduce bucket is turned off (no copy of every gradient), and the
# losses are exactly those of a run that keeps it.
NO_BUCKET = r"""
import json, sys
import torch, deepspeed
import aidaptiv_ds
from transformers import LlamaConfig, LlamaForCausalLM
from aidaptiv_ds.zero3.optimizer import AidaptivZeroOptimizer

cfg = json.load(open(sys.argv[1]))
deepspeed.init_distributed("gloo")
g = torch.Generator().manual_seed(1)
BATCHES = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(3)]


def run():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=256))
    engine = aidaptiv_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    losses = []
    for b in BATCHES:
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    opt = engine.optimizer
    buffers = [getattr(bucket, "buffer", None) is not None for bucket in opt.ipg_buckets.values()]
    return {"losses": losses, "contiguous": opt.contiguous_gradients, "buffers": buffers}


without = run()
AidaptivZeroOptimizer._gradients_need_no_bucket = lambda self: False  # DeepSpeed's own behaviour
kept = run()
print("RESULT " + json.dumps({"without": without, "kept": kept}))
"""


def test_one_rank_on_cpu_needs_no_contiguous_bucket(tmp_path):
    from helpers import aidaptiv_config, run_one_rank_script

    config = aidaptiv_config(tmp_path, "aidaptiv", host_memory_budget="40MiB", layer_group_size=1)
    r = run_one_rank_script(NO_BUCKET, [config], tmp_path)
    assert r["without"]["contiguous"] is False and not any(r["without"]["buffers"])
    assert r["kept"]["contiguous"] is True and all(r["kept"]["buffers"])
    assert r["without"]["losses"] == r["kept"]["losses"]  # the same gradients, bit for bit
