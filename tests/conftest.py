import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # import aidaptiv_ds from this checkout even when not installed
# Test modules import their shared helpers as `helpers` (tests/helpers.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import REPO  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Cells marked `long` (a second, longer cell of something a shorter test already covers, or a bench's own
    cell) are skipped, saying which bench runs them, unless AIDAPTIV_TESTS_LONG=1: the suite stays near 40
    minutes on two cores."""
    if os.environ.get("AIDAPTIV_TESTS_LONG") == "1":
        return
    for item in items:
        mark = item.get_closest_marker("long")
        if mark is not None:
            why = mark.args[0] if mark.args else "a long cell"
            item.add_marker(pytest.mark.skip(reason=f"{why}; AIDAPTIV_TESTS_LONG=1 runs it here"))


def pytest_sessionfinish(session, exitstatus):
    """Remove the session's own rates cache (pytest_sessionstart made it), so runs leave no folder in /tmp."""
    import shutil

    folder = os.environ.get("AIDAPTIV_DS_CACHE_DIR", "")
    if os.path.basename(folder).startswith("aidaptiv-tests-cache-"):
        shutil.rmtree(folder, ignore_errors=True)


def pytest_sessionstart(session):
    """Keep the run apart from this machine's cache of measured rates and tuned I/O settings (aidaptiv_ds.
    machine_cache): with a developer's cache the swapper picks other block sizes and queue depths than in CI,
    so the same suite would test other I/O patterns on each machine. Children inherit the variable.

    Free the RAM that DeepSpeed runs of earlier sessions left in /dev/shm (aidaptiv_ds.zero3.dist_shm): on a
    machine that has run this suite many times it is gigabytes the multi-rank tests then lack."""
    import tempfile

    os.environ["AIDAPTIV_DS_CACHE_DIR"] = tempfile.mkdtemp(prefix="aidaptiv-tests-cache-")
    from aidaptiv_ds import remove_leaked_shared_memory
    from aidaptiv_ds.harness.prebuild import put_build_tools_first

    put_build_tools_first(os.environ)  # one ninja for every DeepSpeed op build of the session and its children
    removed = remove_leaked_shared_memory()
    if removed:
        print(f"\naidaptiv-ds tests: {removed}")


# A phase (setup, call or teardown) of one test that runs longer than this fails with a traceback of where it
# was, instead of holding CI until its own time limit ends the whole run with no report. The slowest phase
# takes about a minute on a 2-core machine; the limit leaves room for a much slower disk.
PHASE_LIMIT_S = int(os.environ.get("AIDAPTIV_TEST_PHASE_LIMIT_S", "900"))


class PhaseTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise PhaseTimeout(
        f"test phase still running after {PHASE_LIMIT_S} s (AIDAPTIV_TEST_PHASE_LIMIT_S); "
        "the traceback shows where it was"
    )


def _limited(phase):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item, *args):
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(PHASE_LIMIT_S)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    hook.__name__ = f"pytest_runtest_{phase}"
    return hook


if PHASE_LIMIT_S > 0:
    pytest_runtest_setup = _limited("setup")
    pytest_runtest_call = _limited("call")
    pytest_runtest_teardown = _limited("teardown")


@pytest.fixture
def repo():
    return REPO
