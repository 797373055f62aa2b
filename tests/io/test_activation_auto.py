"""The auto activation policy (aidaptiv_ds.activations.policy.AutoPolicy) on a Hugging Face Llama with the real
engine: the first training forward measures every block, the plan applies from the next forward, each
block runs in its own mode (keep, stored on NVMe without recompute, recomputed), and the losses and
gradients equal keeping every activation."""

import pytest
import torch
from test_activation_store import LAYERS, Rig, loss_and_grads, tiny_llama

from aidaptiv_ds.activations import policy as activation_policy
from aidaptiv_ds.config.settings import ActivationSettings

SLOW_DISK = 1.0e3  # bytes/s given as the disk's bandwidth: storing is never faster than recomputing


@pytest.fixture
def rig(tmp_path, backend):
    r = Rig(tmp_path, backend)
    yield r
    r.close()


def auto(rig, model, budget, bandwidth=SLOW_DISK):
    store = rig.activation_store()
    settings = ActivationSettings(policy="auto", loss_chunk_tokens=0, budget=budget, nvme_bandwidth=bandwidth)
    plan = activation_policy.apply(model, settings, lambda: store)
    model.train()
    return plan, store


def test_a_budget_that_forces_every_mode_keeps_the_losses_and_gradients(rig):
    # First a plan with room for everything: it keeps every block and reports what each one measured.
    model = tiny_llama()
    auto(rig, model, budget=1 << 40)
    loss_and_grads(model, steps=1)
    first = activation_policy.auto_plan(model)
    assert [b["mode"] for b in first["blocks"]] == ["keep"] * LAYERS and first["fits"]
    # All blocks have one shape: budget one kept block, one recomputed input and what stored blocks leave.
    b = first["blocks"][-1]
    assert b["saved_bytes"] > b["stored_bytes"] // 2 > 0 and b["input_bytes"] == 2 * 96 * 64 * 4
    budget = b["saved_bytes"] + b["input_bytes"] + (LAYERS - 2) * b["left_bytes"]

    reference = loss_and_grads(tiny_llama(), steps=3)
    model = tiny_llama()
    plan, store = auto(rig, model, budget=budget)
    ours = loss_and_grads(model, steps=3)
    s = activation_policy.auto_plan(model)
    # The last block is kept; on a disk this slow recompute wins on time, but only one recomputed input
    # fits beside the kept block, so the earliest blocks are stored.
    assert [b["mode"] for b in s["blocks"]] == ["nvme"] * (LAYERS - 2) + ["recompute", "keep"], s
    assert s["kept_blocks"] == [LAYERS - 1] and s["recomputed_layers"] == [LAYERS - 2]
    assert s["held_bytes"] <= s["budget_bytes"] == budget and s["budget_source"] == "activations.budget"
    assert "does not fit the budget" in s["blocks"][0]["why"] and "recompute takes" in s["blocks"][-2]["why"]
    assert plan["policy"] == "auto" and plan["stored"]
    for (loss, grads), (ref_loss, ref_grads) in zip(ours, reference):
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
        for n, g in grads.items():
            assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-7), n
    # The stored blocks went to the disk in the two steps after the plan, and came back.
    st = store.stats_dict()
    assert st["bytes_stored"] >= 2 * (LAYERS - 2) * b["input_bytes"] and st["bytes_read"] >= st["bytes_stored"]
    assert st["cycles"] == 2 and store.staging_bytes() == 0 and rig.pool.stats()["in_use"] == 0


def test_each_block_runs_in_its_mode(rig):
    model = tiny_llama()
    auto(rig, model, budget=0, bandwidth=1e15)  # nothing kept, a disk faster than any recompute
    calls = [0] * LAYERS
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    loss_and_grads(model, steps=1)
    # Measuring: once under the counting hooks, once as a checkpoint, once more recomputed in the backward.
    assert calls == [3] * LAYERS
    s = activation_policy.auto_plan(model)
    assert s["stored_blocks"] == list(range(LAYERS)) and not s["kept_blocks"] and not s["recomputed_layers"]
    loss_and_grads(model, steps=1)
    assert calls == [4] * LAYERS  # stored, not recomputed
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert calls == [5] * LAYERS


def test_auto_refusals_say_what_to_do(rig):
    settings = ActivationSettings(policy="auto", nvme_bandwidth=1e9)
    with pytest.raises(ValueError, match="no nn.ModuleList of repeated blocks"):
        activation_policy.apply(torch.nn.Linear(4, 4), settings, lambda: rig.activation_store())
    with pytest.raises(ValueError, match="swap space"):
        activation_policy.apply(tiny_llama(), settings, make_store=None)
    with pytest.raises(ValueError, match="nvme_bandwidth"):
        activation_policy.apply(tiny_llama(), ActivationSettings(policy="auto"), lambda: rig.activation_store())


def test_bandwidth_from_the_rates_cache_or_measured_through_the_engine(rig, tmp_path, monkeypatch):
    import json
    import types

    from aidaptiv_ds.engine.machine_cache import disk_key
    from aidaptiv_ds.zero3.activations import nvme_bandwidth

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("AIDAPTIV_DS_CACHE_DIR", raising=False)  # the suite-wide cache (conftest) would win
    runtime = types.SimpleNamespace(
        cfg=types.SimpleNamespace(nvme_path=str(tmp_path)), memory=rig.memory, store=rig.store
    )
    store = rig.activation_store()
    read, write, how = nvme_bandwidth(runtime, store)  # no cache: 4 MiB (an eighth of 32) out and back
    assert read > 0 and write > 0 and how == "measured now: 4 MiB written and read back"
    assert rig.pool.stats()["in_use"] == 0
    (tmp_path / "cache" / "aidaptiv-ds").mkdir(parents=True)
    (tmp_path / "cache" / "aidaptiv-ds" / "rates.json").write_text(
        json.dumps(
            {disk_key(str(tmp_path)): {"nvme_read": 3e9, "nvme_write": 2e9, "when": "measured 2026-01-01 00:00 UTC"}}
        )
    )
    assert nvme_bandwidth(runtime, store) == (3e9, 2e9, "the rates cache (measured 2026-01-01 00:00 UTC)")


def test_default_budget_on_cpu_is_the_host_budget():
    assert activation_policy.default_budget(torch.device("cpu"), 123 << 20) == (
        123 << 20,
        "this rank's host_memory_budget",
    )
    with pytest.raises(ValueError, match="give activations.budget in bytes"):
        activation_policy.default_budget(torch.device("cpu"), None)


def _fake_cuda(monkeypatch, *, free, total, reserved, allocated, fraction):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction)


def test_default_budget_on_cuda_is_half_the_free_memory(monkeypatch):
    """Uncapped: half of what the device has free plus what the allocator caches unused."""
    _fake_cuda(monkeypatch, free=100 << 30, total=140 << 30, reserved=6 << 30, allocated=4 << 30, fraction=1.0)
    assert activation_policy.default_budget(torch.device("cuda", 0), None) == (
        51 << 30,
        "half of the 102.00 GiB GPU memory free when planned",
    )


def test_default_budget_on_cuda_follows_the_process_memory_cap(monkeypatch):
    """--gpu-mem-cap-gb 6 on a 140 GiB card: the device says 100 GiB free, but the allocator may hold only 6 GiB
    and 4 are taken, so the plan gets half of the 2 left (a budget from mem_get_info would keep every
    activation and run out of memory at the cap)."""
    _fake_cuda(monkeypatch, free=100 << 30, total=140 << 30, reserved=5 << 30, allocated=4 << 30, fraction=6 / 140)
    budget, how = activation_policy.default_budget(torch.device("cuda", 0), None)
    assert abs(budget - (1 << 30)) < 2**20
    assert "under this process's cap" in how
