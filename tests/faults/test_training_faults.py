"""Whole training jobs under injected faults (see cases.py for what every case asserts and fault_job.py for
how each fault is made). The uninterrupted reference run doubles as the first of two jobs on one nvme_path.

CI runs one case of each kind that no other test covers (an I/O error, a kill, refused fallbacks, two jobs, an
output folder refused before the first step); the swap space damaged under the job (tests/io/test_store.py),
payloads planted in the checkpoint's pickle files and damaged checkpoints exported
(tests/integration/test_checkpoint_trust.py) are tested nearer their code. Set AIDAPTIV_FAULTS_ALL=1 to run every
case here (EIO on reads, ulimit -f mid-step and mid-save, deleted swap files, each refusal alone), as
bench/faults.py does N times.
"""

import os
import platform

import cases
import pytest

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="the seccomp filters are written for x86_64 and aarch64"
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, and a second job started on its nvme_path while it surely runs (it waits for
    the second to end before its 4th step)."""
    folder = str(tmp_path_factory.mktemp("reference"))
    first = cases.reference(folder, "hold")
    second = cases.second_job(folder, first)
    first.finish()
    assert first.rc == 0 and not first.hang, first.log[-3000:]
    return first, second


def check(row):
    assert not row["hang"], row
    assert not row["crash"], row
    assert row["clear_error"], row
    assert not row["data_lost"], row


def test_a_second_job_on_the_same_nvme_path_is_refused_and_the_first_is_untouched(reference):
    first, second = reference
    assert second.rc == 1 and not second.hang, second.log[-3000:]
    assert f"in use by another job (pid {first.proc.pid} " in second.status and "nvme_path" in second.status
    assert len(first.losses()) == cases.STEPS


# In CI (about 2 minutes on 2 cores): an I/O error, a kill, a refusal of both jobs and an unwritable output. The
# rest, and every case N times: bench/faults.py (planted payloads and NaN weights are also refused in
# tests/integration/test_checkpoint_trust.py).
CI = ["eio-write", "kill9-step", "both-refused", "unwritable-output"]
MORE = [name for name in cases.CASES if name not in CI and name != "two-jobs"]


@pytest.mark.parametrize("name", CI)
def test_fault(name, reference, tmp_path):
    check(cases.run_case(name, str(tmp_path), reference[0].losses()))


@pytest.mark.skipif(
    not os.environ.get("AIDAPTIV_FAULTS_ALL"), reason="bench/faults.py runs it; AIDAPTIV_FAULTS_ALL=1 runs it here"
)
@pytest.mark.parametrize("name", MORE)
def test_more_faults(name, reference, tmp_path):
    check(cases.run_case(name, str(tmp_path), reference[0].losses()))
