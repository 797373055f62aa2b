"""Cell enumeration, ids and run order."""

import itertools

from aidaptiv_ds.harness.grid import (
    BACKENDS,
    Cell,
    cell_id,
    enumerate_cells,
    order_cells,
    validate_grid,
)


def _grid(**kw):
    base = {
        "notes": "test grid",
        "models": ["tiny", "micro"],
        "micro_batches": [1, 2, 4],
        "seq_lens": [16, 64],
        "gpus": [1, 2],
        "steps": 3,
        "warmup": 1,
        "timeout_s": 60,
    }
    base.update(kw)
    return validate_grid(base)


def test_cell_id_is_deterministic_and_complete():
    c = Cell("llama3.1-8b", "zero_infinity", 2, 8, 2048, 10)
    assert c.id == "llama3.1-8b__zero_infinity__g2__mb8__s2048__ga10"
    assert c.id == cell_id("llama3.1-8b", "zero_infinity", 2, 8, 2048, 10)
    assert Cell("llama3.1-8b", "zero_infinity", 2, 8, 2048, 1).id != c.id  # grad_accum is part of the key


def test_enumeration_is_the_full_product():
    cells = enumerate_cells(_grid())
    assert len(cells) == 2 * 3 * 2 * 2 * len(BACKENDS)
    assert enumerate_cells(_grid()) == cells  # same order every time (SLURM array indices rely on it)


def test_overrides_replace_backends_and_gpus():
    cells = enumerate_cells(_grid(), backends=["aidaptiv", "zero3"], gpus=[4])
    assert {c.backend for c in cells} == {"aidaptiv", "zero3"}
    assert {c.gpus for c in cells} == {4}


def test_per_model_values():
    g = _grid(per_model={"tiny": {"micro_batches": [18], "gpus": [1, 2, 4], "grad_accum": 10}})
    tiny = [c for c in enumerate_cells(g) if c.model == "tiny"]
    assert {c.micro_batch for c in tiny} == {18} and {c.gpus for c in tiny} == {1, 2, 4}
    assert {c.grad_accum for c in tiny} == {10}
    micro = [c for c in enumerate_cells(g) if c.model == "micro"]
    assert {c.micro_batch for c in micro} == {1, 2, 4} and {c.grad_accum for c in micro} == {1}


def test_order_small_models_then_cheap_shapes_then_backends_interleaved():
    cells = enumerate_cells(_grid())
    models = [c.model for c in cells]
    assert models == sorted(models, key=lambda m: m != "micro")  # micro (smallest) entirely first
    for model in ("micro", "tiny"):
        costs = [c.micro_batch * c.seq_len for c in cells if c.model == model]
        assert costs == sorted(costs)
    n = len(BACKENDS)
    for i in range(0, len(cells), n):  # each consecutive block is one shape with every backend
        block = cells[i : i + n]
        assert {c.backend for c in block} == set(BACKENDS)
        assert len({(c.model, c.gpus, c.micro_batch, c.seq_len) for c in block}) == 1
    firsts = [cells[i].backend for i in range(0, len(cells), n)]
    assert len(set(firsts[:n])) == n  # the backend that goes first rotates


def test_a_dominating_cell_always_runs_first():
    cells = enumerate_cells(_grid(micro_batches=[1, 2, 3, 4, 8], seq_lens=[16, 32, 64, 128]))
    pos = {c: i for i, c in enumerate(cells)}
    pairs = 0
    for a, b in itertools.permutations(cells, 2):
        if a.dominates(b):
            pairs += 1
            assert pos[a] < pos[b], f"{a.id} must run before {b.id}"
    assert pairs > 100


def test_dominates():
    a = Cell("tiny", "zero3", 1, 2, 64, 1)
    assert a.dominates(Cell("tiny", "zero3", 1, 4, 64, 1))
    assert a.dominates(Cell("tiny", "zero3", 1, 2, 128, 1))
    assert not a.dominates(a)
    assert not a.dominates(Cell("tiny", "zero3", 1, 1, 128, 1))  # smaller batch
    assert not a.dominates(Cell("tiny", "aidaptiv", 1, 4, 64, 1))  # other backend
    assert not a.dominates(Cell("tiny", "zero3", 2, 4, 64, 1))  # other GPU count
    assert not a.dominates(Cell("micro", "zero3", 1, 4, 64, 1))  # other model


def test_order_cells_accepts_any_list():
    cells = [Cell("micro", b, 1, mb, 8, 1) for mb in (4, 1) for b in ("aidaptiv", "zero3")]
    ordered = order_cells(cells)
    assert [c.micro_batch for c in ordered] == [1, 1, 4, 4]
    assert sorted(ordered) == sorted(cells)
