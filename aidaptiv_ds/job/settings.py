"""What one training run is asked to do: :class:`TrainSettings`, typed, with the defaults of ``aidaptiv-ds train``.

``aidaptiv-ds train`` (:mod:`aidaptiv_ds.commands.train`) parses its flags into these settings, one field per flag
(``--seq-len`` is ``seq_len``); a program builds them directly. Errors about a setting name it in backquotes
(`` `save_dir` ``), which the command says as its flag (``--save-dir``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

DEFAULT_MODEL = "tiny"
DEFAULT_SEQ_LEN = 512
DEFAULT_SEED = 1234
DEFAULT_TIMING_WARMUP = 2
# How long a rank waits in a collective for the others before it fails (torch's own default is 30 minutes):
# long enough for the slowest rank's share of a step, a save or an export, short enough that a lost node or a cut
# link ends a cluster job in minutes instead of holding its allocation for half an hour.
DEFAULT_PEER_TIMEOUT_S = 600.0


@dataclass
class TrainSettings:
    """One training run. ``config`` is the DeepSpeed config (a path); everything else overrides it or says
    what the run does around it. See ``aidaptiv-ds train --help`` for each field's meaning."""

    config: str
    # model and data
    model: str = DEFAULT_MODEL
    data: Optional[str] = None
    lora: Optional[str] = None
    router_aux_loss_coef: Optional[float] = None  # MoE load-balancing loss weight; None: the model's own, 0: off
    seed: int = DEFAULT_SEED
    dtype: Optional[str] = None  # fp32 | bf16 | fp16: overrides the config's precision
    eval_fraction: float = 0.0
    eval_data: Optional[str] = None
    # schedule
    steps: Optional[int] = None
    epochs: Optional[float] = None
    seq_len: int = DEFAULT_SEQ_LEN
    micro_batch: Optional[int] = None
    grad_accum: Optional[int] = None
    lr: Optional[float] = None
    lr_schedule: Optional[str] = None
    warmup_steps: int = 0
    eval_every: int = 0
    # memory and swap
    gradient_checkpointing: bool = False
    nvme_path: Optional[str] = None
    create_nvme_path: bool = False
    host_budget: Optional[str] = None  # the block's grammar: a size, a share of RAM, '/node' or '/rank'
    keep_swap: bool = False
    gpu_mem_cap_gb: Optional[float] = None
    no_fit_check: bool = False
    # several ranks
    peer_timeout: float = DEFAULT_PEER_TIMEOUT_S  # seconds a rank waits in a collective for the others
    time_collectives: bool = False  # the metrics say each step's wait on collectives (job/collective_timer.py)
    # checkpoints
    save_dir: Optional[str] = None
    save_every: int = 0
    keep_last: int = 0  # checkpoints kept in save_dir, the newest (0: all)
    resume: Optional[str] = None  # "auto"
    resume_from: Optional[str] = None
    # output
    warmup: int = DEFAULT_TIMING_WARMUP  # steps left out of the timing medians
    metrics_out: Optional[str] = None
    output_dir: Optional[str] = None
    logits_out: Optional[str] = None
    no_progress: bool = False
    verbose: bool = False

    @classmethod
    def from_namespace(cls, ns) -> "TrainSettings":
        """The settings of a parsed command line (attributes named as the fields; others are ignored)."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
