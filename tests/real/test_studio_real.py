"""The studio as a person uses it, walked in a headless browser (Debian's chromium driven by Playwright), with the
real instruct model: a document about an invented place becomes passages and question/answer pairs written by
the model, one passage dropped before the set is saved; the run is planned, and a LoRA run of the tied real model
trains and saves; a full fine-tune of the micro preset far too long to end by itself is watched (its loss curve
grows), stopped, resumed from its checkpoint and stopped again, while a second launch on the same swap disk is
refused; the LoRA run is exported, and Compare asks the base and the fine-tuned model through the chat template;
the Chat tab keeps a conversation of two turns; a sweep folder is shown as its report; a new studio on the same
root finds every run as it was left. The screenshots in docs/studio/ come from this test
(`AIDAPTIV_STUDIO_SCREENSHOTS=docs/studio pytest tests/real/test_studio_real.py`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from helpers import REPO

sys.path.insert(0, os.path.join(REPO, "tests", "studio"))
from studio_browser import CHROMIUM, FLAGS, Studio, choose, fill, run_state, step_shown, tab, wait_for  # noqa: E402

DOCUMENT = os.path.join(REPO, "bench", "documents_qa", "documents", "veltrane_guide.md")


def test_the_studio_walked_in_a_browser_with_a_real_instruct_model(real_folder, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    root = tmp_path / "studio"
    shutil.copytree(real_folder, root / "models" / "smollm2", ignore=shutil.ignore_patterns("aidaptiv_gguf.json"))
    shutil.copytree(Path(REPO) / "bench" / "results" / "cpu_small" / "xeon", root / "sweeps" / "cpu_small")
    shots = Path(os.environ.get("AIDAPTIV_STUDIO_SCREENSHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    studio = Studio(root)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(60_000)
            page.goto(studio.url)

            # Data: the document becomes passages, and the model writes question/answer pairs from them.
            page.locator("#upload input[type=file]").set_input_files(DOCUMENT)
            choose(page, "tok-model", "models/smollm2")
            choose(page, "qa-model", "models/smollm2")
            msg = page.locator("#data-msg")
            fill(page, "set-name", "veltrane")
            page.locator("#add-files").click()
            expect(msg).to_contain_text("is writing questions and answers", timeout=120_000)
            expect(msg).to_contain_text("question/answer records from", timeout=600_000)
            said = msg.inner_text()
            n_passages = int(re.search(r"veltrane_guide\.md: (\d+) passages", said).group(1))
            made = int(re.search(r"wrote (\d+) question/answer records", said).group(1))
            assert n_passages >= 2 and made >= 2, said
            # Drop the second passage (untick keep; the first checkbox is the column's own) before saving.
            second = page.locator("#records input[type=checkbox]").nth(2)
            expect(second).to_be_checked()
            second.click()
            expect(second).not_to_be_checked()
            page.screenshot(path=str(shots / "data.png"), full_page=True)
            page.locator("#save-set").click()
            expect(msg).to_contain_text("Saved", timeout=60_000)
            saved = [json.loads(x) for x in (root / "data" / "veltrane.jsonl").read_text().splitlines()]
            assert f"{len(saved)} records" in msg.inner_text()
            assert len([r for r in saved if set(r) == {"text"}]) == n_passages - 1
            pairs = [r for r in saved if "instruction" in r]
            assert pairs and all(r["instruction"].endswith("?") and r["response"] for r in pairs)

            # Train: a short LoRA run of the tied real model, planned, launched, finished, saved.
            tab(page, "Train")
            fill(page, "run-name", "veltrane-lora")
            choose(page, "model-choice", "models/smollm2")
            fill(page, "seq-len", 128)
            fill(page, "steps", 6)
            fill(page, "save-every", 3)
            page.locator("#plan").click()
            expect(page.locator("#plan-out")).to_contain_text("aidaptiv", timeout=300_000)
            expect(page.locator("#train-msg")).to_contain_text("aidaptiv fits")
            page.screenshot(path=str(shots / "train.png"), full_page=True)
            page.locator("#launch").click()
            expect(page.locator("#train-msg")).to_contain_text("Launched", timeout=120_000)
            wait_for(lambda: run_state(root, "veltrane-lora").get("state") in ("finished", "failed"), 900, "the run")
            log = (root / "runs" / "veltrane-lora" / "train.log").read_text()
            assert run_state(root, "veltrane-lora")["state"] == "finished", log[-3000:]

            # A full fine-tune of the micro preset far too long to end by itself: watched, stopped, resumed,
            # stopped again.
            fill(page, "run-name", "full-run")
            choose(page, "model-choice", "micro")
            page.locator("#mode").get_by_text("Full").click()
            fill(page, "seq-len", 64)
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

            # The LoRA run: its curves, then its export (the adapters merged into the real model).
            choose(page, "run-pick", "veltrane-lora")
            expect(page.locator("#run-status")).to_contain_text("finished", timeout=30_000)
            page.screenshot(path=str(shots / "runs.png"), full_page=True)
            page.locator("#export").click()
            expect(page.locator("#runs-msg")).to_contain_text("Exported", timeout=300_000)
            assert (root / "runs/veltrane-lora/model/config.json").exists()

            # Compare: the base and the fine-tuned model answer a question through the chat template.
            tab(page, "Compare")
            choose(page, "model-a", "models/smollm2")
            choose(page, "model-b", "runs/veltrane-lora/model")
            fill(page, "prompt", "What is the capital of France?")
            page.locator("#compare-btn").click()
            expect(page.locator("#fig-b")).to_contain_text("chat template", timeout=300_000)
            expect(page.locator("#fig-a")).to_contain_text("chat template", timeout=300_000)
            expect(page.locator("#fig-a")).to_contain_text("tokens/s")
            assert "Paris" in page.locator("#out-a textarea").input_value()
            page.screenshot(path=str(shots / "compare.png"), full_page=True)

            # Chat: a conversation of two turns, kept in a file the command line can continue.
            tab(page, "Chat")
            choose(page, "chat-model", "runs/veltrane-lora/model")
            fill(page, "chat-name", "veltrane")
            conversation = root / "chats" / "veltrane.json"
            for turn, question in enumerate(("What is the capital of France?", "And what is the capital of Italy?")):
                page.locator("#chat-text textarea").fill(question)
                page.locator("#chat-send").click()

                def answered(n=turn):
                    said = json.loads(conversation.read_text()) if conversation.exists() else []
                    return len(said) == 2 * (n + 1) and said[-1]["role"] == "assistant"

                wait_for(answered, 300, "the reply in the conversation's file")
                reply = json.loads(conversation.read_text())[-1]["content"]
                expect(page.locator("#chatbot")).to_contain_text(reply[:20], timeout=60_000)
                # The turn has ended (Send takes the next message) once the page numbers its reply.
                expect(page.locator("#chat-msg")).to_contain_text(
                    f"Reply {turn + 1} of chats/veltrane.json", timeout=60_000
                )
            history = json.loads(conversation.read_text())
            assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
            expect(page.locator("#chatbot")).to_contain_text(history[-1]["content"][:20], timeout=60_000)
            page.screenshot(path=str(shots / "chat.png"), full_page=True)

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
            expect(table).to_contain_text("veltrane-lora")
            expect(table).to_contain_text("finished")
            expect(table).to_contain_text("stopped")
            browser.close()
    finally:
        studio.stop()
        # Runs are detached processes: a test that failed half-way must not leave one training (its
        # supervisor sees the request and interrupts it).
        for run in (root / "runs").glob("*/status.json"):
            (run.parent / "stop-requested").write_text(str(time.time()))
