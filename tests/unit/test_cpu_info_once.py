"""DeepSpeed's questions about the CPU are answered once per process (entry_points.remember_cpu_info): py-cpuinfo
starts a Python process that times the CPU on every call, and DeepSpeed 0.19.8 asks five times while it
builds CPU Adam and async_io. A fake cpuinfo module counts the calls."""

import sys
import types

import pytest

from aidaptiv_ds.zero3.entry_points import patch_deepspeed, remember_cpu_info


@pytest.fixture
def fake_cpuinfo(monkeypatch):
    module = types.ModuleType("cpuinfo")
    module.calls = 0

    def get_cpu_info():
        module.calls += 1
        return {"vendor_id_raw": "GenuineIntel", "flags": ["avx2", "avx512f"], "call": module.calls}

    module.get_cpu_info = get_cpu_info
    monkeypatch.setitem(sys.modules, "cpuinfo", module)
    return module


def test_the_cpu_is_asked_once_and_every_caller_gets_its_own_copy(fake_cpuinfo):
    remember_cpu_info()
    remember_cpu_info()  # idempotent: not wrapped twice
    first = fake_cpuinfo.get_cpu_info()
    first["flags"].append("edited by a caller")
    later = [fake_cpuinfo.get_cpu_info() for _ in range(4)]
    assert fake_cpuinfo.calls == 1
    assert first["call"] == 1 and all(
        x == {"vendor_id_raw": "GenuineIntel", "flags": ["avx2", "avx512f"], "call": 1} for x in later
    )
    # DeepSpeed imports the function from the module at each call: that name is the remembering one.
    from cpuinfo import get_cpu_info

    assert get_cpu_info() == later[0] and fake_cpuinfo.calls == 1


def test_a_failed_question_is_asked_again(fake_cpuinfo):
    answers = iter([RuntimeError("cpuid unavailable"), {"flags": []}])

    def flaky():
        fake_cpuinfo.calls += 1
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    fake_cpuinfo.get_cpu_info = flaky
    remember_cpu_info()
    with pytest.raises(RuntimeError):
        fake_cpuinfo.get_cpu_info()  # DeepSpeed falls back to lscpu on an exception: it must still see it
    assert fake_cpuinfo.get_cpu_info() == {"flags": []} == fake_cpuinfo.get_cpu_info()
    assert fake_cpuinfo.calls == 2


def test_the_deepspeed_hook_installs_it(fake_cpuinfo):
    deepspeed = pytest.importorskip("deepspeed")
    patch_deepspeed(deepspeed)
    fake_cpuinfo.get_cpu_info()
    fake_cpuinfo.get_cpu_info()
    assert fake_cpuinfo.calls == 1
