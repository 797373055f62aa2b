"""The DeepSpeed versions we support and the private names we touch, in one place.

We replace ZeRO-3 internals (the parameter and optimizer swappers, the optimizer's gradient buffer, the
coordinator's NVMe prefetch); their names and contracts move between DeepSpeed releases, so we refuse
versions we have not tested instead of failing somewhere in the middle of a run.
"""
from __future__ import annotations

SUPPORTED_MIN = "0.19.0"
SUPPORTED_BELOW = "0.20.0"

# PartitionedParameterCoordinator.__prefetch_nvme (name-mangled): DeepSpeed's per-partition NVMe prefetch.
COORDINATOR_PREFETCH_NVME = "_PartitionedParameterCoordinator__prefetch_nvme"


class UnsupportedDeepSpeedError(RuntimeError):
    pass


def check_deepspeed_version() -> str:
    import deepspeed
    from packaging.version import Version
    found = Version(deepspeed.__version__.split("+")[0])
    if not Version(SUPPORTED_MIN) <= found < Version(SUPPORTED_BELOW):
        raise UnsupportedDeepSpeedError(
            f"aidaptiv-ds supports DeepSpeed >={SUPPORTED_MIN},<{SUPPORTED_BELOW} (it replaces ZeRO-3 internals "
            f"that change between releases) but found {deepspeed.__version__}: install a supported one with "
            "pip install --no-build-isolation 'deepspeed==0.19.8'")
    return str(found)


def disable_deepspeed_nvme_prefetch(coordinator) -> None:
    if not hasattr(coordinator, COORDINATOR_PREFETCH_NVME):
        raise UnsupportedDeepSpeedError("DeepSpeed's parameter coordinator has no NVMe prefetch flag where 0.19 "
                                        "keeps it: this DeepSpeed is not supported")
    setattr(coordinator, COORDINATOR_PREFETCH_NVME, False)
