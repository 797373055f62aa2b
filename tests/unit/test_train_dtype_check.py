"""The train job refuses to train in a dtype the config did not ask for (issue 11), whatever DeepSpeed chose."""

import types

import pytest
import torch

from aidaptiv_ds.job.failures import TrainingFailed
from aidaptiv_ds.job.train import Run


def _model(dtype):
    model = torch.nn.Linear(4, 4).to(dtype)
    for p in model.parameters():
        # ZeRO-Infinity's placeholder for a partition swapped out to NVMe: not the training dtype, not looked at
        p.ds_tensor = torch.empty(1, dtype=torch.float16)
    return model


def test_partitions_in_the_asked_dtype_pass():
    Run.check_partition_dtype(types.SimpleNamespace(dtype=torch.float32), _model(torch.float32))


def test_partitions_in_another_dtype_stop_the_job_with_the_reason():
    with pytest.raises(TrainingFailed, match="asks for float32 but DeepSpeed partitioned parameters in bfloat16"):
        Run.check_partition_dtype(types.SimpleNamespace(dtype=torch.float32), _model(torch.bfloat16))
