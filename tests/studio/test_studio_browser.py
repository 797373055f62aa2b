"""The studio as a person uses it, in a real headless browser (Debian's chromium driven by Playwright):
upload a document, build and save a data set, plan, launch a short LoRA and a full fine-tune of the micro
preset, watch the loss curve grow, stop and resume the full run, export, and compare the base with the
fine-tuned model, then restart the studio and find the runs again. A screenshot of each tab is taken (to
docs/studio/ with `AIDAPTIV_STUDIO_SCREENSHOTS=docs/studio pytest tests/studio/test_studio_browser.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
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

DOC = """# The swap space

Every layer's weights live on the SSD and are read ahead of the compute that needs them, so a model
larger than memory still trains.

The host budget caps the pinned memory that holds the layers being computed and the ones read ahead.

When the budget is small the layer groups are small, and the disk is read more often but never waited on
longer than the computation takes.
"""


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


def test_the_workflow_in_a_browser(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    root, shots = tmp_path / "studio", shots_dir(tmp_path)
    doc = tmp_path / "swap-notes.md"
    doc.write_text(DOC * 4)
    (root / "sweeps").mkdir(parents=True)
    shutil.copytree(Path(REPO) / "bench" / "results" / "cpu_small" / "xeon", root / "sweeps" / "cpu_small")
    studio = Studio(root)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(60_000)
            page.goto(studio.url)

            # Data: a document becomes passages, saved as the JSONL train reads.
            page.locator("#upload input[type=file]").set_input_files(str(doc))
            fill(page, "set-name", "notes")
            page.locator("#add-files").click()
            expect(page.locator("#data-msg")).to_contain_text("swap-notes.md:", timeout=60_000)
            n_passages = int(re.search(r"(\d+) passages", page.locator("#data-msg").inner_text()).group(1))
            assert n_passages >= 2
            # Drop the second row (untick keep; the first checkbox is the column's own) before saving.
            boxes = page.locator("#records input[type=checkbox]")
            expect(boxes).to_have_count(n_passages + 1)
            boxes.nth(2).click()
            expect(boxes.nth(2)).not_to_be_checked()
            page.locator("#save-set").click()
            expect(page.locator("#data-msg")).to_contain_text("Saved", timeout=60_000)
            saved = [json.loads(line) for line in (root / "data" / "notes.jsonl").read_text().splitlines()]
            assert len(saved) == n_passages - 1 and all(set(r) == {"text"} for r in saved)
            assert f"{n_passages - 1} records" in page.locator("#data-msg").inner_text()
            assert "read ahead of the compute" in " ".join(r["text"] for r in saved)
            page.screenshot(path=str(shots / "data.png"), full_page=True)

            # Train: plan, then a short LoRA run.
            tab(page, "Train")
            fill(page, "run-name", "lora-run")
            fill(page, "seq-len", 64)
            fill(page, "steps", 6)
            fill(page, "save-every", 2)
            page.locator("#plan").click()
            expect(page.locator("#plan-out")).to_contain_text("aidaptiv", timeout=120_000)
            expect(page.locator("#train-msg")).to_contain_text("aidaptiv **fits**".replace("**", ""))
            page.screenshot(path=str(shots / "train.png"), full_page=True)
            page.locator("#launch").click()
            expect(page.locator("#train-msg")).to_contain_text("Launched", timeout=120_000)
            wait_for(lambda: run_state(root, "lora-run").get("state") in ("finished", "failed"), 300, "the LoRA run")
            assert run_state(root, "lora-run")["state"] == "finished", (root / "runs/lora-run/train.log").read_text()

            # A full fine-tune far too long to end by itself here: watched, stopped, resumed, stopped again.
            fill(page, "run-name", "full-run")
            page.locator("#mode").get_by_text("Full").click()
            fill(page, "steps", 5000)
            fill(page, "save-every", 10)
            page.locator("#launch").click()
            expect(page.locator("#train-msg")).to_contain_text("Launched full-run", timeout=120_000)
            # A second run on the same swap folder is refused while the first trains (before any plan is made).
            fill(page, "run-name", "second-run")
            page.locator("#launch").click()
            expect(page.locator("#train-msg")).to_contain_text("one training at a time per swap disk")
            assert not (root / "runs" / "second-run").exists()
            tab(page, "Runs")
            expect(page.locator("#run-pick input")).to_have_value("full-run")

            def grows_past(step):
                seen = set()

                def check():
                    seen.add(step_shown(page))
                    return len({s for s in seen if s > 0}) >= 2 and max(seen) > step

                return check

            wait_for(grows_past(12), 300, "the loss curve to grow past step 12 over two refreshes")
            assert page.locator("#loss-plot canvas, #loss-plot svg").count() > 0
            expect(page.locator("#run-status")).to_contain_text("running")
            page.screenshot(path=str(shots / "runs.png"), full_page=True)
            page.locator("#stop").click()
            expect(page.locator("#runs-msg")).to_contain_text("stopping full-run")
            wait_for(lambda: run_state(root, "full-run").get("state") == "stopped", 120, "the run to stop")
            expect(page.locator("#run-status")).to_contain_text("stopped", timeout=30_000)
            stopped_at = int((root / "runs/full-run/checkpoints/latest").read_text().strip().removeprefix("step"))
            assert stopped_at >= 10 and stopped_at % 10 == 0, stopped_at
            page.locator("#resume").click()
            expect(page.locator("#runs-msg")).to_contain_text("attempt 2")
            wait_for(grows_past(stopped_at + 10), 300, "the resumed run's curve to grow past its checkpoint")
            log = (root / "runs/full-run/train.log").read_text()
            assert f"at step {stopped_at}" in log, log[-3000:]
            assert run_state(root, "full-run")["attempt"] == 2
            page.locator("#stop").click()
            wait_for(lambda: run_state(root, "full-run").get("state") == "stopped", 120, "the resumed run to stop")
            again = int((root / "runs/full-run/checkpoints/latest").read_text().strip().removeprefix("step"))
            assert again > stopped_at, (again, stopped_at)

            # Export the LoRA run (merged, and its base) and compare the two side by side.
            choose(page, "run-pick", "lora-run")
            page.locator("#export").click()
            expect(page.locator("#runs-msg")).to_contain_text("Exported", timeout=180_000)
            assert (root / "runs/lora-run/model/config.json").exists()
            assert (root / "runs/lora-run/base/config.json").exists()
            tab(page, "Compare")
            choose(page, "model-a", "runs/lora-run/base")
            choose(page, "model-b", "runs/lora-run/model")
            fill(page, "prompt", "The swap space")
            page.locator("#compare-btn").click()
            expect(page.locator("#fig-a")).to_contain_text("tokens/s", timeout=120_000)
            expect(page.locator("#fig-b")).to_contain_text("tokens/s", timeout=120_000)
            page.screenshot(path=str(shots / "compare.png"), full_page=True)

            # A sweep folder under the root is shown as its report's tables and figures.
            tab(page, "Runs")
            page.get_by_text("Sweeps").click()
            page.locator("#sweep-pick input").click()
            page.locator('#sweep-pick [role=option][aria-label="sweeps/cpu_small"]').click()
            page.locator("#sweep-show").click()
            expect(page.locator("#sweep-report")).to_contain_text("aidaptiv", timeout=120_000)
            expect(page.locator("#sweep-figures img").first).to_be_visible(timeout=30_000)
            assert "(figure:" in page.locator("#sweep-report").inner_text()
            page.locator("#sweep-report").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "sweep.png"))
            browser.close()
        studio.stop()

        # A new studio on the same root finds every run as it was left.
        studio = Studio(root)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(studio.url)
            tab(page, "Runs")
            table = page.locator("#runs-table")
            expect(table).to_contain_text("full-run", timeout=30_000)
            expect(table).to_contain_text("lora-run")
            expect(table).to_contain_text("finished")
            expect(table).to_contain_text("stopped")
            browser.close()
    finally:
        studio.stop()
        # Runs are detached processes: a test that failed half-way must not leave one training (its
        # supervisor sees the request and interrupts it).
        for run in (root / "runs").glob("*/status.json"):
            (run.parent / "stop-requested").write_text(str(time.time()))
