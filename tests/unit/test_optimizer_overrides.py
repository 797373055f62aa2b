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
