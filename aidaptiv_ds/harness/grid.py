"""Sweep grids: the schema of bench/grids/*.json, and the cells a grid expands to.

A grid names model presets and the batch x sequence x GPU values to run them at; ``per_model`` overrides
those lists for one model (Signal65 ran each model at its own micro-batch). A cell is one
(model, backend, gpus, micro_batch, seq_len, grad_accum); its id is a deterministic string from exactly
those fields, used as the resume key and as the name of its log folder. With ``repeats`` > 1 each cell runs
that many times; a run is (cell, repeat), and the runs are interleaved: every cell once, then every cell
again, so a slow spell of the machine falls on all backends alike rather than on one cell's repeats.

Everything here is pure (no processes, no files but the grid), so it is cheap to test.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from aidaptiv_ds.common.sizes import state_bytes_per_param
from aidaptiv_ds.config.ds_config import BACKENDS
from aidaptiv_ds.config.schema import ActivationsConfig
from aidaptiv_ds.harness.eqmem import BACKEND as EQMEM_BACKEND
from aidaptiv_ds.models.presets import PRESETS, nominal_parameters


def _known_names(names, known, kind: str, field: str):
    """``names`` unchanged when every one is in ``known`` and none repeats; ValueError otherwise."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {kind} {unknown}: expected some of {list(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{field} has repeated names: {names}")
    return names


# What a sweep can run, in report column order: the four configurations of ds_configs/, and ZeRO-Infinity with
# aidaptiv's host memory (harness/eqmem.py), whose config the sweep derives per cell from zero_infinity.json.
SWEEP_BACKENDS = ("zero3", "zero3_cpu_offload", "zero_infinity", EQMEM_BACKEND, "aidaptiv")
assert set(BACKENDS) <= set(SWEEP_BACKENDS)


class GridError(ValueError):
    """A grid file that cannot be used; ``problems`` lists every problem found, not just the first."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"grid {source} has {len(problems)} problem(s):\n{lines}")


def _positive_unique(name: str, values: list[int]) -> list[int]:
    bad = [v for v in values if v <= 0]
    if bad:
        raise ValueError(f"{name} must be positive integers, got {bad}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} has repeated values: {values}")
    return values


class ModelOverride(BaseModel):
    """Values that replace the grid-wide lists for one model; fields left out keep the grid's."""

    model_config = ConfigDict(extra="forbid")

    micro_batches: Optional[list[int]] = Field(None, min_length=1)
    """Micro-batch sizes per GPU for this model."""
    seq_lens: Optional[list[int]] = Field(None, min_length=1)
    """Sequence lengths (tokens) for this model."""
    gpus: Optional[list[int]] = Field(None, min_length=1)
    """GPU (process) counts for this model."""
    grad_accum: Optional[Union[int, list[int]]] = None
    """Gradient accumulation steps for this model (one value or a list)."""
    aidaptiv_state_fraction: Optional[float] = Field(None, gt=0, lt=1)
    """aidaptiv's host budget for this model, as a fraction of its ZeRO-3 state (see Grid)."""
    notes: Optional[str] = None
    """Where these values come from."""

    @field_validator("micro_batches", "seq_lens", "gpus")
    @classmethod
    def _check_list(cls, v, info):
        return None if v is None else _positive_unique(info.field_name, v)

    @field_validator("grad_accum")
    @classmethod
    def _check_ga(cls, v):
        if v is None:
            return None
        return _positive_unique("grad_accum", [v] if isinstance(v, int) else v)


class Grid(BaseModel):
    """A sweep grid (bench/grids/*.json). Unknown keys are errors, and every problem is reported at once."""

    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = None
    """Short name; defaults to the file name without .json."""
    notes: Optional[str] = None
    """Where the grid comes from (paper, table, figure) and what it is for (free text, optional)."""
    models: list[str] = Field(min_length=1)
    """Model presets (see PRESETS) to run."""
    micro_batches: Optional[list[int]] = Field(None, min_length=1)
    """Micro-batch sizes per GPU, unless per_model says otherwise (then it may be left out)."""
    seq_lens: Optional[list[int]] = Field(None, min_length=1)
    """Sequence lengths in tokens, unless per_model says otherwise (then it may be left out)."""
    gpus: Optional[list[int]] = Field(None, min_length=1)
    """Total GPU (on CPU: process) counts, unless per_model says otherwise; --gpus replaces them."""
    grad_accum: Union[int, list[int]] = 1
    """Gradient accumulation steps (one value or a list)."""
    steps: int = Field(gt=0)
    """Optimizer steps per cell, warm-up included; --steps replaces it."""
    warmup: int = Field(ge=0)
    """Steps excluded from timing; --warmup replaces it."""
    timeout_s: float = Field(gt=0)
    """Wall-clock limit per cell, launcher start-up included; the cell's process tree is killed after it."""
    repeats: int = Field(1, ge=1)
    """Runs per cell, interleaved (every cell once, then every cell again); each run is its own row with its
    repeat index; --repeats replaces it."""
    backends: list[str] = Field(default_factory=lambda: list(BACKENDS), min_length=1)
    """Backends to run by default (ds_configs/<name>.json, or zero_infinity_eqmem: zero_infinity.json sized
    to aidaptiv's host budget, which needs aidaptiv_state_fraction); --backends replaces them."""
    dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None
    """Training precision of every cell: the sweep writes OUT/ds_configs/<backend>.json with it set (as train's
    --dtype would) and runs, sizes and predicts the cells from those; unset: each config's own."""
    lr: Optional[float] = Field(None, gt=0)
    """Learning rate of the published runs (recorded in rows; does not change throughput)."""
    gpu_mem_cap_gb: Optional[float] = Field(None, gt=0)
    """GPU memory per process to emulate (e.g. 40 for an A100 40GB); --gpu-mem-cap-gb replaces it."""
    host_mem_cap_gb: Optional[float] = Field(None, gt=0)
    """Host memory per cell to emulate; --host-mem-cap-gb replaces it."""
    aidaptiv_state_fraction: Optional[float] = Field(None, gt=0, lt=1)
    """aidaptiv cells get a host budget (--host-budget) of this fraction of the model's ZeRO-3 state (20
    bytes per parameter in fp32, split over the ranks), so that the RAM cache tier stays below the state and
    most of it really moves through NVMe; unset: the config's budget."""
    aidaptiv_activations: Optional[ActivationsConfig] = None
    """The aidaptiv cells' activations (the block's "activations" object: policy keep, recompute, nvme or auto,
    loss_chunk_tokens, ...): the sweep writes OUT/ds_configs/aidaptiv.json with it, and the planner's OOM
    predictions of those cells follow it; unset: the config's own. The other backends are unchanged."""
    per_model: dict[str, ModelOverride] = Field(default_factory=dict)
    """Per-model replacements of micro_batches / seq_lens / gpus / grad_accum."""

    @field_validator("models")
    @classmethod
    def _check_models(cls, v):
        return _known_names(v, PRESETS, "model preset(s)", "models")

    @field_validator("backends")
    @classmethod
    def _check_backends(cls, v):
        return _known_names(v, SWEEP_BACKENDS, "backend(s)", "backends")

    @field_validator("micro_batches", "seq_lens", "gpus")
    @classmethod
    def _check_list(cls, v, info):
        return None if v is None else _positive_unique(info.field_name, v)

    @field_validator("grad_accum")
    @classmethod
    def _check_ga(cls, v):
        return _positive_unique("grad_accum", [v] if isinstance(v, int) else v)

    def aidaptiv_budget_bytes(self, model: str, gpus: int) -> Optional[int]:
        """Per-rank host budget of an aidaptiv cell (None: the config's own)."""
        o = self.per_model.get(model) or ModelOverride()
        fraction = o.aidaptiv_state_fraction or self.aidaptiv_state_fraction
        if not fraction or not nominal_parameters(model):
            return None
        # ZeRO-3 state of the model in fp32 with the optimizer offloaded, shared by the ranks.
        return int(fraction * state_bytes_per_param() * nominal_parameters(model) / gpus)

    def values_for(self, model: str) -> tuple[list[int], list[int], list[int], list[int]]:
        """(micro_batches, seq_lens, gpus, grad_accums) for one model, per_model overrides applied."""
        o = self.per_model.get(model) or ModelOverride()
        ga = o.grad_accum if o.grad_accum is not None else self.grad_accum
        return (
            o.micro_batches or self.micro_batches,
            o.seq_lens or self.seq_lens,
            o.gpus or self.gpus,
            list(ga) if isinstance(ga, list) else [ga],
        )


def _loc(parts: Iterable) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif "." in str(p) or "-" in str(p):
            out += f"[{str(p)!r}]"
        else:
            out += f".{p}" if out else str(p)
    return out or "(top level)"


def _cross_field_problems(data) -> list[str]:
    """Checks that relate two fields, done on the raw data so they are reported with the field errors."""
    problems = []
    if not isinstance(data, dict):
        return problems
    steps, warmup = data.get("steps"), data.get("warmup")
    if isinstance(steps, int) and isinstance(warmup, int) and 0 <= steps <= warmup:
        problems.append(f"warmup ({warmup}) must be smaller than steps ({steps}): no step would be timed")
    models, per_model = data.get("models"), data.get("per_model", {})
    backends = data.get("backends")
    if isinstance(backends, list) and EQMEM_BACKEND in backends and isinstance(models, list):
        unsized = [
            m
            for m in models
            if isinstance(m, str)
            and not data.get("aidaptiv_state_fraction")
            and not (
                isinstance(per_model, dict)
                and isinstance(per_model.get(m), dict)
                and per_model[m].get("aidaptiv_state_fraction")
            )
        ]
        if unsized:
            problems.append(
                f"backend {EQMEM_BACKEND} is sized to aidaptiv's host budget, but models {unsized} "
                "have no aidaptiv_state_fraction: set one (top level or per_model)"
            )
    if isinstance(models, list) and isinstance(per_model, dict):
        stray = [m for m in per_model if m not in models]
        if stray:
            problems.append(f"per_model names {stray}, which are not in models {models}")
        for field in ("micro_batches", "seq_lens", "gpus"):
            if data.get(field) is not None:
                continue
            lacking = [
                m
                for m in models
                if isinstance(m, str)
                and not (isinstance(per_model.get(m), dict) and per_model[m].get(field) is not None)
            ]
            if lacking:
                problems.append(f"{field} is missing: give it at the top level or in per_model for {lacking}")
    return problems


def validate_grid(data, source: str = "<grid>") -> Grid:
    """Validate a grid's parsed JSON; raise GridError listing every problem."""
    problems = []
    grid = None
    try:
        grid = Grid.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{_loc(err['loc'])}: {msg}")
    problems += _cross_field_problems(data)
    if problems:
        raise GridError(source, problems)
    return grid


def load_grid(path: str) -> Grid:
    """Read and validate a grid file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise GridError(path, [f"cannot be read ({e.strerror}): check the path"]) from e
    except json.JSONDecodeError as e:
        raise GridError(path, [f"is not valid JSON: {e}"]) from e
    grid = validate_grid(data, path)
    if grid.name is None:
        grid.name = os.path.splitext(os.path.basename(path))[0]
    return grid


@dataclass(frozen=True, order=True)
class Cell:
    """One run: a model at one shape on one backend with one GPU count."""

    model: str
    backend: str
    gpus: int
    micro_batch: int
    seq_len: int
    grad_accum: int

    @property
    def id(self) -> str:
        """Deterministic key, also a folder name: model__backend__gG__mbB__sL__gaA."""
        return cell_id(self.model, self.backend, self.gpus, self.micro_batch, self.seq_len, self.grad_accum)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.grad_accum * self.gpus

    def dominates(self, other: "Cell") -> bool:
        """True when ``other`` needs at least this cell's memory: same model, backend, GPU count and grad
        accumulation, and no smaller micro-batch or sequence. (More GPUs are not compared: they shard GPU
        state but add host processes, so the order is not clear for a host cap.)"""
        return (
            self != other
            and self.model == other.model
            and self.backend == other.backend
            and self.gpus == other.gpus
            and self.grad_accum == other.grad_accum
            and other.micro_batch >= self.micro_batch
            and other.seq_len >= self.seq_len
        )


@dataclass(frozen=True)
class Run:
    """One run of a cell: its repeat index (0-based) among the grid's repeats."""

    cell: Cell
    repeat: int = 0

    @property
    def id(self) -> str:
        """The cell's id for repeat 0 (so grids without repeats keep their folders and resume keys), else
        <cell id>__r<repeat>; also the name of the run's log folder."""
        return run_id(self.cell.id, self.repeat)


def run_id(cell_key: str, repeat: int) -> str:
    return cell_key if repeat == 0 else f"{cell_key}__r{repeat}"


def interleave_repeats(cells: list[Cell], repeats: int) -> list[Run]:
    """Every cell once in ``cells``' order, then every cell again, ``repeats`` times."""
    return [Run(c, r) for r in range(repeats) for c in cells]


def cell_id(model: str, backend: str, gpus: int, micro_batch: int, seq_len: int, grad_accum: int) -> str:
    return f"{model}__{backend}__g{gpus}__mb{micro_batch}__s{seq_len}__ga{grad_accum}"


def _model_rank(model: str) -> tuple:
    return (nominal_parameters(model) or 0, model)


def enumerate_cells(grid: Grid, backends: Optional[list[str]] = None, gpus: Optional[list[int]] = None) -> list[Cell]:
    """All cells of a grid, in run order (see order_cells). ``backends`` / ``gpus`` replace the grid's."""
    backends = list(backends or grid.backends)
    cells = []
    for model in grid.models:
        mbs, seqs, gpu_counts, gas = grid.values_for(model)
        for g in gpus or gpu_counts:
            for mb in mbs:
                for seq in seqs:
                    for ga in gas:
                        for b in backends:
                            cells.append(Cell(model, b, g, mb, seq, ga))
    return order_cells(cells, backends)


def order_cells(cells: list[Cell], backends: Optional[list[str]] = None) -> list[Cell]:
    """Run order: small models first; within a model cheap shapes first (micro-batch x sequence, then
    GPU count), so a cell that must run out of memory comes after the smaller one that tells us so; for each
    shape every backend in turn, so each backend has results early. The backend order rotates by one from
    shape to shape, so no backend always runs right after another one (the disk is shared and noisy)."""
    if backends is None:
        backends = [b for b in SWEEP_BACKENDS if any(c.backend == b for c in cells)]
        backends += sorted({c.backend for c in cells} - set(backends))
    shapes = sorted(
        {(c.model, c.gpus, c.micro_batch, c.seq_len, c.grad_accum) for c in cells},
        key=lambda s: (_model_rank(s[0]), s[2] * s[3], s[3], s[2], s[1], s[4]),
    )
    by_shape: dict[tuple, list[Cell]] = {}
    for c in cells:
        by_shape.setdefault((c.model, c.gpus, c.micro_batch, c.seq_len, c.grad_accum), []).append(c)
    ordered = []
    for i, shape in enumerate(shapes):
        rot = i % len(backends)
        rank = {b: (j - rot) % len(backends) for j, b in enumerate(backends)}
        ordered += sorted(by_shape[shape], key=lambda c: rank.get(c.backend, len(backends)))
    return ordered
