"""DeepSpeed's shared-memory all-reduce segments on CPU: release ours, remove ones earlier runs leaked.

On the CPU accelerator, when every rank is on one machine (the deepspeed launcher sets LOCAL_SIZE, also for
a single process), DeepSpeed 0.19.8's communicator creates one POSIX shared-memory segment per rank (66 MiB
each, named as :data:`compat.SHM_ALLREDUCE_SEGMENT` says) and never unlinks it.
Training does not use it (only inference all-reduce does), yet every such run leaves 66 MiB of RAM per rank
behind in tmpfs until reboot: a few hundred runs of a sweep or a test suite fill /dev/shm and starve the host
of the memory the runs themselves need.

Each rank maps every rank's segment while the process group starts, so once all ranks have passed a barrier
after that, a rank may unlink its own name: the mappings stay valid until the processes exit, and nothing is
left behind even if a run is later killed.
"""

from __future__ import annotations

import glob
import os
import time
import warnings

from aidaptiv_ds.zero3.compat import SHM_ALLREDUCE_PREFIX, SHM_ALLREDUCE_SEGMENT

SHM_DIR = "/dev/shm"


def own_segment(rank: int, env=None, shm_dir: str = SHM_DIR) -> str:
    """Path of the segment DeepSpeed created for ``rank`` of this job (named as its shm.cpp names it)."""
    env = os.environ if env is None else env
    name = SHM_ALLREDUCE_SEGMENT.format(
        uid=os.getuid(), master_addr=env.get("MASTER_ADDR", ""), master_port=env.get("MASTER_PORT", ""), rank=rank
    )
    return os.path.join(shm_dir, name)


def release_own_segment(rank: int, env=None, shm_dir: str = SHM_DIR) -> bool:
    """Unlink this rank's segment. Call only after every rank has passed a barrier that follows
    deepspeed.init_distributed (each rank opens the others' segments there). True if there was one."""
    path = own_segment(rank, env, shm_dir)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:  # the communicator was not built or not used (CUDA, torchrun, no launcher)
        return False
    except OSError as e:  # a leak is no reason to stop a training run: say so and go on
        warnings.warn(
            f"could not remove DeepSpeed's shared-memory segment {path}: {e.strerror} (errno {e.errno}); "
            "it holds RAM until removed: delete it once the run has ended",
            RuntimeWarning,
            stacklevel=2,
        )
        return False


def release_after_barrier() -> bool:
    """In a CPU job whose process group is up: barrier (with more than one rank), then unlink this rank's
    segment. Every rank must call it (the barrier is a collective). One rank counts too: under the deepspeed
    launcher with one process, LOCAL_SIZE is 1 and DeepSpeed makes rank 0's segment all the same. A no-op on
    CUDA, where DeepSpeed uses NCCL and makes none."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or torch.cuda.is_available():
        return False
    if dist.get_world_size() > 1:
        dist.barrier()
    return release_own_segment(dist.get_rank())


def _mapped_paths(proc: str = "/proc") -> set[str]:
    """Every file a live process maps (all we can see: other users' maps are unreadable, and so skipped)."""
    mapped = set()
    for maps in glob.glob(os.path.join(proc, "[0-9]*", "maps")):
        try:
            with open(maps) as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6:
                        mapped.add(fields[5].strip())
        except OSError:
            continue  # the process exited meanwhile, or is not ours to read
    return mapped


def stale_segments(min_age_s: float = 600, shm_dir: str = SHM_DIR, proc: str = "/proc") -> list[tuple[str, int]]:
    """(path, bytes) of this user's all-reduce segments that no live process maps and that are older than
    ``min_age_s`` (a younger one may belong to a job still starting up)."""
    now, uid = time.time(), os.getuid()
    candidates = []
    for path in sorted(glob.glob(os.path.join(shm_dir, f"{SHM_ALLREDUCE_PREFIX}_{uid}_*"))):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == uid and now - st.st_mtime > min_age_s:
            candidates.append((path, st.st_size))
    if not candidates:
        return []
    mapped = _mapped_paths(proc)
    return [(p, size) for p, size in candidates if p not in mapped]


def remove_stale_segments(min_age_s: float = 600, shm_dir: str = SHM_DIR, proc: str = "/proc") -> tuple[int, int]:
    """Remove what stale_segments finds; returns (segments removed, bytes freed)."""
    count = freed = 0
    for path, size in stale_segments(min_age_s, shm_dir, proc):
        try:
            os.unlink(path)
        except OSError:
            continue
        count, freed = count + 1, freed + size
    return count, freed


def describe_removed(count: int, freed: int) -> str:
    return (
        f"removed {count} shared-memory segment(s) ({freed / 2**20:.0f} MiB of RAM in {SHM_DIR}) that earlier "
        "DeepSpeed runs on CPU left behind"
    )
