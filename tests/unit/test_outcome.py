"""Classifying a cell's outcome from exit code, signal, output and metrics, without running anything."""

import subprocess
import sys

import pytest

from aidaptiv_ds.harness.outcome import classify, decode_exit, error_line, fault_line

TRACEBACK = [
    "[2026-11-21 07:44:04,767] [INFO] [launch.py:158:main] nnodes=1, num_local_procs=1, node_rank=0",
    "Traceback (most recent call last):",
    '  File "/x/train.py", line 12, in <module>',
    "    main()",
    "[rank0]: RuntimeError: Expected all tensors to be on the same device",
    "[2026-11-21 07:44:10,349] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u'] exits with return code = 1",
]
CUDA_OOM = [
    "Traceback (most recent call last):",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity",
]
OK = {"status": "ok", "tokens_per_s": 100.0}
# The H100 run's crash (bench/results/gpu_probe/h100/crash_probe_fp32.log), shortened: a progress bar, then the
# fault handler's dump with the crashing thread after another thread's frames.
FAULT = [
    "  return func(*args, **kwargs)",
    "train micro:  25%|##5       | 1/4 [00:00<00:01, loss=7.8627, tok_s=471]Fatal Python error: Segmentation fault",
    "",
    "Thread 0x00007efd67ff76c0 (most recent call first):",
    '  File "/usr/lib/python3.12/threading.py", line 359 in wait',
    "",
    "Current thread 0x00007f0133b32300 (most recent call first):",
    '  File "/work/main/aidaptiv_ds/io.py", line 108 in allocate',
    '  File "/work/main/aidaptiv_ds/store.py", line 440 in _allocate',
    "",
    "Extension modules: regex._regex, numpy._core._multiarray_umath (total: 2)",
]


@pytest.mark.parametrize(
    "kw, status, error_has",
    [
        # train's own verdicts
        (dict(returncode=0, metrics=OK), "ok", None),
        (
            dict(returncode=3, metrics={"status": "oom", "error": "torch.OutOfMemoryError: CUDA out of memory"}),
            "oom",
            "CUDA out of memory",
        ),
        (dict(returncode=1, metrics={"status": "error", "error": "ValueError: bad config"}), "error", "bad config"),
        # refused by train's launch guard: an out-of-memory the plan predicted, said to be one
        (
            dict(returncode=3, metrics={"status": "refused", "error": "host memory: zero3 needs at least 7.3 GiB"}),
            "oom",
            "refused before training by the plan: host memory: zero3 needs",
        ),
        # train said error, but the error is an out-of-memory one
        (
            dict(returncode=1, metrics={"status": "error", "error": "RuntimeError: CUDA error: out of memory"}),
            "oom",
            "out of memory",
        ),
        # ok metrics, but the process did not exit cleanly: not ok
        (dict(returncode=1, metrics=OK, output_tail=["RuntimeError: NCCL teardown"]), "error", "after writing ok"),
        (dict(returncode=-11, metrics=OK), "error", "SIGSEGV"),
        # no metrics: output and exit code decide
        (dict(returncode=1, output_tail=CUDA_OOM), "oom", "CUDA out of memory"),
        (dict(returncode=1, output_tail=["MemoryError"]), "oom", "MemoryError"),
        (dict(returncode=3, output_tail=["something"]), "oom", "exit code 3"),
        (dict(returncode=1, output_tail=TRACEBACK), "error", "RuntimeError: Expected all tensors"),
        (dict(returncode=0), "error", "wrote no metrics"),
        (dict(returncode=0, metrics_problem="metrics file metrics.json is unreadable (x)"), "error", "unreadable"),
        (dict(returncode=247), "error", "killed by SIGKILL"),  # a rank SIGKILLed, through the deepspeed launcher
        (dict(returncode=-9), "error", "killed by SIGKILL"),
        (dict(returncode=245, output_tail=["Segmentation fault"]), "error", "SIGSEGV"),
        # a native crash names its frame, not the warning printed last
        (
            dict(returncode=245, output_tail=FAULT),
            "error",
            "killed by SIGSEGV: Segmentation fault in /work/main/aidaptiv_ds/io.py:108 (allocate)",
        ),
        (dict(returncode=2), "error", "exit code 2"),
        # harness verdicts override everything
        (dict(returncode=-15, timed_out=True, timeout_s=30.0), "timeout", "30 s"),
        (dict(returncode=-15, timed_out=True, timeout_s=30.0, metrics=OK), "timeout", "hung at exit"),
        (
            dict(returncode=247, cap_kill="killed by the host memory cap (cgroup1 limit 1.00 GiB, oom_kill count 1)"),
            "oom",
            "host memory cap",
        ),
        (
            dict(returncode=-9, cap_kill="killed by the host memory cap (rss-watchdog): ...", metrics=None),
            "oom",
            "rss-watchdog",
        ),
    ],
)
def test_classify(kw, status, error_has):
    kw.setdefault("timed_out", False)
    out = classify(**kw)
    assert out.status == status, out
    if error_has is None:
        assert out.error is None
    else:
        assert error_has in out.error, out.error


def test_cap_kill_does_not_turn_a_clean_ok_into_oom():
    # e.g. a compiler child of a finished cell was OOM-killed: the measurement still stands
    out = classify(returncode=0, timed_out=False, cap_kill="killed by the host memory cap", metrics=OK)
    assert out.status == "ok"


def test_decode_exit():
    assert decode_exit(0) == (0, None)
    assert decode_exit(-9) == (-9, "SIGKILL")
    assert decode_exit(247) == (247, "SIGKILL")  # sys.exit(-9) in deepspeed's launch.py
    assert decode_exit(137) == (137, "SIGKILL")  # a shell's 128+9
    assert decode_exit(3) == (3, None)
    assert decode_exit(None) == (None, None)


def test_error_line_prefers_the_exception_over_launcher_chatter():
    assert error_line(TRACEBACK) == "RuntimeError: Expected all tensors to be on the same device"
    assert error_line(["plain last words", ""]) == "plain last words"
    assert error_line([]) is None


def test_fault_line_without_a_dump_or_a_frame():
    assert fault_line(["  return func(*args, **kwargs)"]) is None
    assert fault_line(["Fatal Python error: Aborted", ""]) == "Aborted"


def test_the_cli_turns_on_the_fault_handler():
    """Any aidaptiv-ds command: a native crash afterwards prints the crashing Python stack (pytest's own fault
    handler is not in the child)."""
    code = (
        "import ctypes\nfrom aidaptiv_ds.cli import main\n"
        "try:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
        "ctypes.string_at(0)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -11, p.stderr[-2000:]
    lines = p.stderr.splitlines()
    where = fault_line(lines)
    assert where.startswith("Segmentation fault in ") and where.endswith("(string_at)"), p.stderr[-2000:]
