"""The DeepSpeed versions we support, and the names and layouts of DeepSpeed's that are not its public API but
that we rely on: private (name-mangled) attributes, the modules whose bindings we replace, where ZeRO-Infinity
keeps its swap files, what its CPU communicator calls its shared-memory segments.

We replace ZeRO-3 internals (the parameter and optimizer swappers, the optimizer's gradient buffer, the
coordinator's NVMe prefetch, the swappers' I/O handle builder); their names and contracts move between
DeepSpeed releases, so we refuse versions we have not tested (:func:`check_deepspeed_version`) instead of
failing somewhere in the middle of a run. The modules that use these names sit beside this one in
``aidaptiv_ds/zero3/``, which also implement DeepSpeed's swapper and optimizer interfaces under the names those interfaces have.
"""

from __future__ import annotations

import contextlib
import os
import shutil

SUPPORTED_MIN = "0.19.0"
SUPPORTED_BELOW = "0.20.0"
TESTED = "0.19.8"

# -- private attributes (name-mangled ones spelt as Python stores them) ------------------------------------
# PartitionedParameterCoordinator.__prefetch_nvme: DeepSpeed's per-partition NVMe prefetch.
COORDINATOR_PREFETCH_NVME = "_PartitionedParameterCoordinator__prefetch_nvme"
# zero.Init._set_dtype: picks the partition dtype (its precedence bug is mended by entry_points).
ZERO_INIT_SET_DTYPE = "_set_dtype"
# DeepSpeedZeroOptimizer_Stage3.__param_id_to_grad_partition: its dict of gradient partitions.
STAGE3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"

# -- modules that bind ``AsyncIOBuilder`` at import time (``from deepspeed.ops.op_builder import
# AsyncIOBuilder``) and build their swap handles with it; optimizer_utils and utils only receive handles.
ASYNC_IO_BUILDER = "AsyncIOBuilder"
SWAP_MODULES_BINDING_ASYNC_IO = (
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
)

# -- ZeRO-Infinity's swap files: <nvme_path>/zero_stage_3/<kind>/rank<r>/..., one <kind> per dtype of
# parameters (float32params, bfloat16params, ...) and one for the optimizer.
ZERO_INFINITY_SWAP_FOLDER = "zero_stage_3"
ZERO_INFINITY_RANK_FOLDER = "rank{rank}"

# -- the CPU communicator's POSIX shared-memory segment, one per rank, named as its shm.cpp names it:
# /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>.
SHM_ALLREDUCE_PREFIX = "deepspeed_allreduce_buffer"
SHM_ALLREDUCE_SEGMENT = SHM_ALLREDUCE_PREFIX + "_{uid}_{master_addr}_{master_port}_{rank}"


# -- the monitors DeepSpeed's MonitorMaster holds (attributes set on rank 0 only) and the engine's own step
# for them: the engine logs its monitor events at step = engine.global_samples (see zero3/monitors.py).
MONITOR_WANDB = "wandb_monitor"
MONITORS_WITH_OWN_STEPS = ("tb_monitor", "csv_monitor", "comet_monitor")
ENGINE_SAMPLES = "global_samples"


class UnsupportedDeepSpeedError(RuntimeError):
    pass


# Versions the suite has run on; others are refused (the private names above move between releases), except
# inside the range below when the user says so, at their own risk.
TESTED_VERSIONS = (TESTED,)
UNTESTED_ENV = "AIDAPTIV_DS_UNTESTED_DEEPSPEED"


def check_deepspeed_version() -> str:
    import deepspeed
    from packaging.version import Version

    found = Version(deepspeed.__version__.split("+")[0])
    if str(found) in TESTED_VERSIONS:
        return str(found)
    install = f"pip install --no-build-isolation 'deepspeed=={TESTED}'"
    if not Version(SUPPORTED_MIN) <= found < Version(SUPPORTED_BELOW):
        raise UnsupportedDeepSpeedError(
            f"aidaptiv-ds supports DeepSpeed {', '.join(TESTED_VERSIONS)} (it replaces ZeRO-3 internals that change "
            f"between releases) but found {deepspeed.__version__}: install a supported one with {install}"
        )
    if os.environ.get(UNTESTED_ENV) != "1":
        raise UnsupportedDeepSpeedError(
            f"aidaptiv-ds is tested with DeepSpeed {', '.join(TESTED_VERSIONS)} but found {deepspeed.__version__}: "
            f"install a tested one with {install}, or set {UNTESTED_ENV}=1 to run this 0.19 release untested"
        )
    import warnings

    warnings.warn(
        f"aidaptiv-ds runs on untested DeepSpeed {deepspeed.__version__} ({UNTESTED_ENV}=1); tested: "
        f"{', '.join(TESTED_VERSIONS)}"
    )
    return str(found)


def training_on_host() -> bool:
    """Whether DeepSpeed's accelerator is the CPU, so that its device buffers are host memory."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def disable_deepspeed_nvme_prefetch(coordinator) -> None:
    if not hasattr(coordinator, COORDINATOR_PREFETCH_NVME):
        raise UnsupportedDeepSpeedError(
            "DeepSpeed's parameter coordinator has no NVMe prefetch flag where 0.19 "
            "keeps it: this DeepSpeed is not supported"
        )
    setattr(coordinator, COORDINATOR_PREFETCH_NVME, False)


def set_deepspeed_log_level(level: int) -> None:
    """Level of DeepSpeed's own logger (``deepspeed.utils.logger``), which it sets to INFO at import."""
    from deepspeed.utils import logger

    logger.setLevel(level)


def zero_infinity_swap_dirs(nvme_path: str, rank: int) -> list[str]:
    """This rank's folders in ZeRO-Infinity's swap layout under ``nvme_path`` (see the names above), existing
    ones only; links are not followed (we delete what we find)."""
    base = os.path.join(nvme_path, ZERO_INFINITY_SWAP_FOLDER)
    if not os.path.isdir(base) or os.path.islink(base):
        return []
    found = []
    for kind in sorted(os.listdir(base)):
        d = os.path.join(base, kind, ZERO_INFINITY_RANK_FOLDER.format(rank=rank))
        if os.path.isdir(d) and not os.path.islink(d):
            found.append(d)
    return found


def remove_zero_infinity_swap(nvme_paths, rank: int, keep: bool = False) -> list[str]:
    """This rank's ZeRO-Infinity swap folders under each of ``nvme_paths``, removed (with a kind folder that is
    then empty) unless ``keep``; returns them."""
    dirs = [d for p in nvme_paths for d in zero_infinity_swap_dirs(p, rank)]
    if keep:
        return dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):  # the kind folder, once every rank has emptied it
            os.rmdir(os.path.dirname(d))
    return dirs


# -- checkpoints: DeepSpeed's default tag, which rank writes a folder's shared files, its checkpoint engine
# (decoupled engines publish asynchronously), and the one call through which it writes each file.
def default_checkpoint_tag(engine) -> str:
    return f"global_step{engine.global_steps}"


def checkpoint_writer_rank(engine) -> int:
    """The rank number DeepSpeed's save_checkpoint uses for the folder's shared files (0 writes them)."""
    return engine.local_rank if engine.use_node_local_storage() else engine.global_rank


def checkpoint_engine_is_decoupled(engine) -> bool:
    ce = getattr(engine, "checkpoint_engine", None)
    return bool(ce is not None and ce.is_decoupled())


def worst_on_any_rank(engine, value: int) -> int:
    """The largest of every rank's ``value`` (an all-reduce MAX on the engine's device); ``value`` alone when
    the run has one rank. What makes every rank decide alike about a checkpoint one of them found bad."""
    from deepspeed import comm as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    import torch

    flag = torch.tensor([value], dtype=torch.int32, device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def checkpoint_data_classes() -> list:
    """The classes DeepSpeed 0.19.8 pickles into a ZeRO-3 checkpoint besides tensors and plain data (its
    optimizer states hold the loss scaler and the ZeRO stage): what a load with ``weights_only=True`` must
    allow, and nothing else."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [LossScaler, DynamicLossScaler, ZeroStageEnum]


def load_as_data(path: str, map_location=None, mmap: bool = False):
    """``torch.load(path, weights_only=True)`` allowing only :func:`checkpoint_data_classes`: a file that holds any
    other object raises ``pickle.UnpicklingError`` before the object is built. ``mmap`` maps the tensors' bytes
    instead of reading them (what a check that only unpickles needs)."""
    import torch

    with torch.serialization.safe_globals(checkpoint_data_classes()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class checkpoint_loads_as_data:
    """For a ``with``: DeepSpeed's checkpoint engine loads each file with :func:`load_as_data` (DeepSpeed 0.19.8
    loads with ``weights_only=False``, which runs whatever a planted pickle asks); ``refuse(path, error)`` makes
    the exception raised for a file that holds anything else or cannot be read."""

    def __init__(self, engine, refuse):
        self.engine, self.refuse, self.saved = engine, refuse, None

    def __enter__(self):
        ce = self.engine.checkpoint_engine
        self.saved = ce.load
        refuse = self.refuse

        def load(path, map_location=None, *args, **kwargs):
            try:
                return load_as_data(path, map_location=map_location)
            except Exception as e:  # UnpicklingError, a truncated zip (RuntimeError), OSError: all say "refused"
                raise refuse(path, e) from None

        ce.load = load
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.engine.checkpoint_engine.load = self.saved


# -- the scripts DeepSpeed 0.19.8 copies into a save dir (``DeepSpeedEngine._copy_recovery_script(save_dir)``,
# called by rank 0 from ``_save_zero_checkpoint``): they rebuild fp32 weights from *_optim_states.pt, unpickled
# with weights_only=False, which an aidaptiv checkpoint does not keep its weights in.
COPY_RECOVERY_SCRIPT = "_copy_recovery_script"
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


class recovery_scripts_replaced:
    """For a ``with`` around DeepSpeed's save: instead of copying :data:`RECOVERY_SCRIPTS` into the save dir,
    DeepSpeed calls ``write(save_dir)``."""

    def __init__(self, engine, write):
        self.engine, self.write, self.replaced = engine, write, False

    def __enter__(self):
        if not callable(getattr(self.engine, COPY_RECOVERY_SCRIPT, None)):
            raise UnsupportedDeepSpeedError(
                f"DeepSpeed's engine has no {COPY_RECOVERY_SCRIPT} where 0.19 copies {', '.join(RECOVERY_SCRIPTS)} "
                "into a save folder: this DeepSpeed is not supported"
            )
        setattr(self.engine, COPY_RECOVERY_SCRIPT, self.write)  # an instance attribute hides the method
        self.replaced = True
        return self

    def __exit__(self, *exc):
        if self.replaced:
            delattr(self.engine, COPY_RECOVERY_SCRIPT)


class checkpoint_file_hooks:
    """For a ``with``: ``hook(label)`` runs before and after each file DeepSpeed's checkpoint engine saves
    (``checkpoint_engine.save(state_dict, path)``), when ``active`` (aidaptiv's test hooks are set, see
    aidaptiv_ds.common.durable); otherwise it changes nothing."""

    def __init__(self, engine, hook, active: bool):
        self.engine, self.hook, self.active, self.saved = engine, hook, active, None

    def __enter__(self):
        if not self.active:
            return self
        ce = self.engine.checkpoint_engine
        self.saved = ce.save
        hook, save = self.hook, ce.save

        def hooked(state_dict, path, *args, **kwargs):
            hook(f"before DeepSpeed's {os.path.basename(path)}")
            out = save(state_dict, path, *args, **kwargs)
            hook(f"after DeepSpeed's {os.path.basename(path)}")
            return out

        ce.save = hooked
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.engine.checkpoint_engine.save = self.saved
