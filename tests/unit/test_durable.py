"""aidaptiv_ds.common.durable: a checkpoint folder and its `latest` are published so that a kill -9 at any point
leaves the previous checkpoint or the new one, never a missing, mixed or half-written one."""

import errno
import os
import subprocess
import sys

import pytest

from aidaptiv_ds.common import durable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A save as engine_hooks does it, with a folder of two files standing in for a checkpoint: staging folder,
# files written (the second one in two halves), published, `latest` replaced.
SAVE = """
import os, sys
import crash_hooks  # tests/crash_hooks.py: AIDAPTIV_DS_TEST_CRASH_AT from this process's environment
from aidaptiv_ds.common import durable
crash_hooks.install_from_env()
save_dir, tag, content, exchange = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
if exchange == "no":
    def refuse(a, b):
        raise OSError(22, "no exchange here")
    durable.exchange = refuse
staging = os.path.join(save_dir, durable.begin(save_dir, tag))
with open(os.path.join(staging, "a.bin"), "w") as f:
    f.write(content)
durable.crash_point("a written")
with open(os.path.join(staging, "b.bin"), "w") as f:
    f.write(content[:2])
    f.flush()
    durable.crash_point("half of b written")
    f.write(content[2:])
durable.crash_point("b written")
durable.publish(save_dir, tag, save_latest=True)
"""


def _save(save_dir, tag, content, exchange="yes", crash_at=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    env.pop("AIDAPTIV_DS_TEST_CRASH_AT", None)
    if crash_at is not None:
        env["AIDAPTIV_DS_TEST_CRASH_AT"] = str(crash_at)
    return subprocess.run(
        [sys.executable, "-c", SAVE, str(save_dir), tag, content, exchange],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _loadable(save_dir):
    """The content the checkpoint `latest` names, as a load sees it (after recover), or None."""
    latest = os.path.join(save_dir, "latest")
    if not os.path.exists(latest):
        return None
    tag = open(latest).read().strip()
    durable.recover(str(save_dir), tag)
    a = open(os.path.join(save_dir, tag, "a.bin")).read()
    b = open(os.path.join(save_dir, tag, "b.bin")).read()
    assert a == b, f"a mix of two saves in {tag}: {a!r} / {b!r}"
    return a


def _points(tmp_path, *args):
    """How many crash points a save over a checkpoint "OLD-1" at tag t1 has (counted by running it killed
    at 1, 2, ... until a run completes)."""
    for k in range(1, 100):
        d = tmp_path / f"probe{k}"
        assert _save(d, "t1", "OLD-1").returncode == 0
        p = _save(d, *args, crash_at=k)
        if p.returncode == 0:
            return k - 1
        assert p.returncode == -9, p.stderr
    raise AssertionError("more than 100 crash points")


@pytest.mark.parametrize("exchange", ["yes", "no"], ids=["renameat2-exchange", "two-renames"])
@pytest.mark.parametrize("same_tag", [True, False], ids=["same-tag", "new-tag"])
def test_kill_at_every_point_of_a_save_leaves_the_old_or_the_new_checkpoint(tmp_path, exchange, same_tag):
    n = _points(tmp_path, "t1" if same_tag else "t2", "NEW-2", exchange)
    assert n >= 10, n
    seen = set()
    for k in range(1, n + 2):
        d = tmp_path / f"run{k}"
        assert _save(d, "t1", "OLD-1").returncode == 0
        p = _save(d, "t1" if same_tag else "t2", "NEW-2", exchange, crash_at=k)
        assert p.returncode == (-9 if k <= n else 0), p.stderr
        got = _loadable(d)
        assert got in ("OLD-1", "NEW-2"), (k, got)
        seen.add(got)
        # The next save after the crash cleans up and publishes normally.
        assert _save(d, "t3", "NEXT-3", exchange).returncode == 0
        assert _loadable(d) == "NEXT-3"
        assert not [x for x in os.listdir(d) if x.startswith(".")], os.listdir(d)
    assert seen == {"OLD-1", "NEW-2"}


def test_first_save_killed_leaves_nothing_to_load(tmp_path):
    for k in (1, 3, 5):
        d = tmp_path / f"run{k}"
        assert _save(d, "t1", "NEW-1", crash_at=k).returncode == -9
        assert _loadable(d) is None


def test_exchange_swaps_two_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("A")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("B")
    try:
        durable.exchange(str(tmp_path / "a"), str(tmp_path / "b"))
    except OSError as e:
        pytest.skip(f"this filesystem cannot exchange folders ({e})")
    assert (tmp_path / "a" / "x").read_text() == "B" and (tmp_path / "b" / "x").read_text() == "A"


def test_exchange_failure_names_errno(tmp_path):
    with pytest.raises(OSError) as e:
        durable.exchange(str(tmp_path / "missing"), str(tmp_path / "other"))
    assert e.value.errno == errno.ENOENT


def test_write_text_atomically_replaces_whole(tmp_path):
    p = tmp_path / "latest"
    durable.write_text_atomically(str(p), "one")
    durable.write_text_atomically(str(p), "two")
    assert p.read_text() == "two" and os.listdir(tmp_path) == ["latest"]
