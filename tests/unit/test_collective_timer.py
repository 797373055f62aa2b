"""train --time-collectives: the time a step waits on a collective is counted where the rank waits, in the call
for a synchronous one and on the handle for an asynchronous one (ZeRO-3's gathers), per kind and per step."""

import time

import torch
import torch.distributed as dist

from aidaptiv_ds.job.collective_timer import CollectiveTimer


class _Work:
    def __init__(self, wait_s):
        self.wait_s = wait_s

    def wait(self):
        time.sleep(self.wait_s)
        return True

    def is_completed(self):
        return False


def test_an_asynchronous_collective_is_timed_on_its_handle_and_a_synchronous_one_in_its_call():
    timer = CollectiveTimer()
    gather = timer._timed("all_gather_into_tensor", lambda async_op=False: _Work(0.05) if async_op else None)
    reduce = timer._timed("all_reduce", lambda: time.sleep(0.03))
    timer.start_step()
    handle = gather(async_op=True)
    assert timer.seconds["all_gather_into_tensor"] < 0.02  # the call returned at once
    assert handle.is_completed() is False  # the rest of the handle is the work's own
    assert handle.wait() is True
    reduce()
    timer.end_step()
    timer.start_step()
    timer.end_step()  # a step with no collective
    (first, second) = timer.steps
    assert first["all_gather_into_tensor"][1] == 1 and first["all_gather_into_tensor"][0] >= 0.05
    assert first["all_reduce"][1] == 1 and first["all_reduce"][0] >= 0.03
    assert second == {}
    summary = timer.summary(warmup=0)
    assert summary["all_reduce"]["calls_per_step"] == 0.5  # median of 1 and 0


def test_installed_around_a_real_process_group_and_removed():
    original = dist.all_gather_into_tensor
    timer = CollectiveTimer()
    timer.install()
    try:
        assert dist.all_gather_into_tensor is not original
        own = not dist.is_initialized()  # an earlier test in this process may have left its group up
        if own:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            out = torch.empty(4)
            timer.start_step()
            dist.all_gather_into_tensor(out, torch.arange(4.0), async_op=True).wait()
            dist.all_reduce(torch.ones(2))
            timer.end_step()
        finally:
            if own:
                dist.destroy_process_group()
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert {k: v[1] for k, v in timer.steps[0].items()} == {"all_gather_into_tensor": 1, "all_reduce": 1}
    finally:
        timer.uninstall()
    assert dist.all_gather_into_tensor is original
