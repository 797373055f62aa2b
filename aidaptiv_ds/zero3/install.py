"""Put our swappers into DeepSpeed ZeRO-3 by replacing the swapper and optimizer classes ZeRO-3 looks up.

After :func:`install`, DeepSpeed builds :class:`AidaptivParamSwapper` instead of its own parameter swapper,
and :class:`AidaptivZeroOptimizer` instead of its ZeRO-3 optimizer, for every config; both defer to DeepSpeed
unchanged unless the config has an enabled ``"aidaptiv"`` block. Installing twice is a no-op. The other names
we replace in DeepSpeed are replaced elsewhere in zero3: ``AsyncIOBuilder`` in its swap modules by
:mod:`.aio_builder`, ``deepspeed.initialize`` and ``deepspeed.zero.Init`` by :mod:`.entry_points`.
"""

from __future__ import annotations

import atexit
import logging
import weakref

from aidaptiv_ds.config.resolve import settings_for
from aidaptiv_ds.zero3 import compat

log = logging.getLogger(__name__)
_installed = False
_runtimes = weakref.WeakSet()


def _close_all_at_exit():
    for runtime in list(_runtimes):
        try:
            runtime.close()
        except Exception as e:  # at exit: report, never raise
            log.warning("aidaptiv: closing swap space %s at exit failed: %s", runtime.space.path, e)


def install() -> None:
    global _installed
    if _installed:
        return
    compat.check_deepspeed_version()
    import deepspeed.runtime.zero.partition_parameters as partition_parameters
    import deepspeed.runtime.zero.stage3 as stage3
    from deepspeed import comm as dist
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (
        PartitionedParamStatus,
    )

    from aidaptiv_ds.zero3.param_swapper import AidaptivParamSwapper, ParamStatus
    from aidaptiv_ds.zero3.runtime import SwapRuntime

    ParamStatus.AVAILABLE = PartitionedParamStatus.AVAILABLE
    ParamStatus.NOT_AVAILABLE = PartitionedParamStatus.NOT_AVAILABLE
    ParamStatus.INFLIGHT = PartitionedParamStatus.INFLIGHT

    deepspeed_swapper = partition_parameters.AsyncPartitionedParameterSwapper

    def parameter_swapper(ds_config, model_dtype):
        # DeepSpeed passes only its config object: the settings resolved for its "aidaptiv" block are
        # looked up, not parsed again.
        settings = settings_for(ds_config)
        if settings is None:
            return deepspeed_swapper(ds_config, model_dtype)
        runtime = SwapRuntime(settings, dist.get_rank(), model_dtype)
        _runtimes.add(runtime)
        return AidaptivParamSwapper(runtime)

    partition_parameters.AsyncPartitionedParameterSwapper = parameter_swapper
    from aidaptiv_ds.zero3.optimizer import AidaptivZeroOptimizer

    stage3.DeepSpeedZeroOptimizer_Stage3 = AidaptivZeroOptimizer
    atexit.register(_close_all_at_exit)
    _installed = True
