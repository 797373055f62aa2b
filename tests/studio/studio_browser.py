"""Helpers for walking the studio in a real headless browser (Debian's chromium driven by Playwright): the
studio as a child process on a free port, and the few page actions the walk repeats. Importing this module
skips the importing test where playwright or the browser is missing, saying which."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO

CHROMIUM = os.environ.get("AIDAPTIV_CHROMIUM", "/usr/bin/chromium")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (scripts/setup.sh)")
if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"no browser at {CHROMIUM}: scripts/test.sh installs Debian's chromium (apt), or set AIDAPTIV_CHROMIUM",
        allow_module_level=True,
    )
# Flags a browser needs on a machine without network or display (background requests are refused here).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
FLAGS += ["--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Studio:
    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = open(root.parent / f"studio-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aidaptiv_ds", "studio", "--root", str(root), "--port", str(self.port)],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("the studio did not start in 120 s:\n" + Path(self.log.name).read_text())

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def shots_dir(tmp_path: Path) -> Path:
    d = Path(os.environ.get("AIDAPTIV_STUDIO_SCREENSHOTS") or tmp_path / "shots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def tab(page, name):
    page.get_by_role("tab", name=name).click()


def fill(page, elem_id, value):
    box = page.locator(f"#{elem_id} input, #{elem_id} textarea").first
    box.fill(str(value))
    box.press("Tab")


def choose(page, elem_id, option):
    page.locator(f"#{elem_id} input").click()
    # Every dropdown's option list stays in the page: take the option inside this one.
    page.locator(f'#{elem_id} [role=option][aria-label="{option}"]').click()
    page.keyboard.press("Escape")
    expect_value(page, elem_id, option)


def expect_value(page, elem_id, value):
    from playwright.sync_api import expect

    expect(page.locator(f"#{elem_id} input")).to_have_value(value)


def run_state(root: Path, run: str) -> dict:
    try:
        return json.loads((root / "runs" / run / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def wait_for(cond, timeout_s, what):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def step_shown(page) -> int:
    m = re.search(r"step (\d+)", page.locator("#run-status").inner_text())
    return int(m.group(1)) if m else -1
