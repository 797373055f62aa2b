"""zero.Init honours an explicit dtype whatever the CPU reports (the hook mends DeepSpeed 0.19.8's precedence).

On an AMD EPYC, DeepSpeed's CPU accelerator reports no fp16, and ``Init(dtype=torch.float32)`` (the path the
engine takes for a model not built under zero.Init) gave bf16 partitions: every fp32 ZeRO-3 run died in its
first forward. The accelerator's answer is forced here so that the test means the same on every CPU.
"""

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from aidaptiv_ds.zero3 import compat  # noqa: E402
from aidaptiv_ds.zero3.entry_points import honour_explicit_dtype  # noqa: E402
from aidaptiv_ds.zero3.originals import original_zero_init  # noqa: E402


@pytest.fixture
def no_fp16(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)


def _chosen(set_dtype, ds_config, dtype):
    holder = type("Holder", (), {})()
    set_dtype(holder, ds_config, dtype)
    return holder.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_explicit_dtype_wins_on_a_cpu_without_fp16(no_fp16, dtype):
    honour_explicit_dtype(deepspeed)
    init_cls = original_zero_init(deepspeed)
    patched = getattr(init_cls, compat.ZERO_INIT_SET_DTYPE)
    # DeepSpeed's own choice drops the explicit fp32 (this is the bug being mended)...
    assert _chosen(patched.__wrapped__, None, torch.float32) == torch.bfloat16
    # ...ours keeps it.
    assert _chosen(patched, None, dtype) == dtype


def test_without_a_dtype_deepspeed_still_decides(no_fp16):
    honour_explicit_dtype(deepspeed)
    patched = getattr(original_zero_init(deepspeed), compat.ZERO_INIT_SET_DTYPE)
    assert _chosen(patched, None, None) == _chosen(patched.__wrapped__, None, None)


def test_mending_twice_wraps_once():
    honour_explicit_dtype(deepspeed)
    first = getattr(original_zero_init(deepspeed), compat.ZERO_INIT_SET_DTYPE)
    honour_explicit_dtype(deepspeed)
    assert getattr(original_zero_init(deepspeed), compat.ZERO_INIT_SET_DTYPE) is first
