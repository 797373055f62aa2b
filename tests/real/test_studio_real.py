"""The studio with the real instruct model, walked in a headless browser as a user would: a document about an
invented place becomes passages and question/answer pairs written by the model; a LoRA run on it trains, saves
(its head tied to the embedding), exports; Compare asks the base and the fine-tuned model through the chat
template; the Chat tab keeps a conversation. The screenshots in docs/studio/ come from this test
(`AIDAPTIV_STUDIO_SCREENSHOTS=docs/studio pytest tests/real/test_studio_real.py`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from helpers import REPO

sys.path.insert(0, os.path.join(REPO, "tests", "studio"))
browser_test = pytest.importorskip("test_studio_browser", reason="the studio's browser test helpers")
Studio, choose, fill, run_state, tab, wait_for = (
    browser_test.Studio,
    browser_test.choose,
    browser_test.fill,
    browser_test.run_state,
    browser_test.tab,
    browser_test.wait_for,
)
CHROMIUM, FLAGS = browser_test.CHROMIUM, browser_test.FLAGS
DOCUMENT = os.path.join(REPO, "bench", "documents_qa", "documents", "veltrane_guide.md")


def test_the_studio_with_a_real_instruct_model(real_folder, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    root = tmp_path / "studio"
    shutil.copytree(real_folder, root / "models" / "smollm2", ignore=shutil.ignore_patterns("aidaptiv_gguf.json"))
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
            tok = page.locator("#data-msg")
            fill(page, "set-name", "veltrane")
            page.locator("#add-files").click()
            expect(tok).to_contain_text("is writing questions and answers", timeout=120_000)
            expect(tok).to_contain_text("question/answer records from", timeout=600_000)
            said = tok.inner_text()
            made = int(re.search(r"wrote (\d+) question/answer records", said).group(1))
            assert made >= 2, said
            page.screenshot(path=str(shots / "data.png"), full_page=True)
            page.locator("#save-set").click()
            expect(tok).to_contain_text("Saved", timeout=60_000)
            saved = [json.loads(x) for x in (root / "data" / "veltrane.jsonl").read_text().splitlines()]
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
            expect(page.locator("#train-msg")).to_contain_text("fits", timeout=300_000)
            page.screenshot(path=str(shots / "train.png"), full_page=True)
            page.locator("#launch").click()
            expect(page.locator("#train-msg")).to_contain_text("Launched", timeout=120_000)
            wait_for(lambda: run_state(root, "veltrane-lora").get("state") in ("finished", "failed"), 900, "the run")
            log = (root / "runs" / "veltrane-lora" / "train.log").read_text()
            assert run_state(root, "veltrane-lora")["state"] == "finished", log[-3000:]
            tab(page, "Runs")
            choose(page, "run-pick", "veltrane-lora")
            expect(page.locator("#run-status")).to_contain_text("finished", timeout=30_000)
            page.screenshot(path=str(shots / "runs.png"), full_page=True)
            page.locator("#export").click()
            expect(page.locator("#runs-msg")).to_contain_text("Exported", timeout=300_000)

            # Compare: the base and the fine-tuned model answer a question through the chat template.
            tab(page, "Compare")
            choose(page, "model-a", "models/smollm2")
            choose(page, "model-b", "runs/veltrane-lora/model")
            fill(page, "prompt", "What is the capital of France?")
            page.locator("#compare-btn").click()
            expect(page.locator("#fig-b")).to_contain_text("chat template", timeout=300_000)
            expect(page.locator("#fig-a")).to_contain_text("chat template", timeout=300_000)
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
            history = json.loads((root / "chats" / "veltrane.json").read_text())
            assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
            expect(page.locator("#chatbot")).to_contain_text(history[-1]["content"][:20], timeout=60_000)
            page.screenshot(path=str(shots / "chat.png"), full_page=True)
            browser.close()
    finally:
        studio.stop()
        for run in (root / "runs").glob("*/status.json"):
            (run.parent / "stop-requested").write_text("stop")
