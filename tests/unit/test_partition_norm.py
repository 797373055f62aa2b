"""A gradient partition's norm for ZeRO-3's clipping, without DeepSpeed's fp64 copy of the partition."""

import pytest
import torch

from aidaptiv_ds.zero3.gradients import NORM_ROW, partition_norm


def deepspeed_norm(grad):
    """DeepSpeed 0.19.8's _constant_buffered_norm2 on CPU (fp64, one buffer)."""
    return (grad.view(-1).to(torch.float64).norm(2) ** 2.0) ** 0.5


@pytest.mark.parametrize("numel", [1, NORM_ROW - 1, NORM_ROW, 3 * NORM_ROW + 17, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partition_norm_agrees_with_deepspeeds(numel, dtype):
    torch.manual_seed(numel)
    grad = (torch.randn(numel) * 1e-3).to(dtype)
    ours, theirs = partition_norm(grad), deepspeed_norm(grad)
    assert ours.dtype == torch.float64 and ours.dim() == 0
    assert abs(float(ours) - float(theirs)) <= 1e-7 * float(theirs)  # a row summed in fp32


def test_zero_and_empty_partitions():
    assert float(partition_norm(torch.zeros(5 * NORM_ROW))) == 0.0
    assert float(partition_norm(torch.zeros(0))) == 0.0
