"""Two models answer one prompt side by side: one ``aidaptiv-ds generate`` process each (an instruct model's
through its chat template), their text read as they print it (token by token), their figures from --metrics-out
at the end.

The second process starts once the first has laid out its weights (the line generate prints when it has) or
ended: each sizes its default budgets from the memory free when it starts (on a GPU, three quarters of the GPU
memory free), so two started together would both plan for the same free memory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from aidaptiv_ds.studio import children
from aidaptiv_ds.studio.workspace import StudioError, has_chat_template

# What `aidaptiv-ds generate` prints on stderr once its weights are laid out (commands/generate.py).
LAID_OUT = ", laid out in "


class _Side:
    """One generate process, its output gathered by a reader thread."""

    def __init__(self, model: str, prompt: str, max_new_tokens: int, folder: Path, tag: str, host_budget, nvme_path):
        self.metrics = folder / f"{tag}.json"
        argv = [sys.executable, "-m", "aidaptiv_ds", "generate", "--model", model, "--prompt", prompt]
        # an instruct model is asked as it is used, through its chat template (bare, it may answer nothing)
        self.chat = has_chat_template(model)
        if self.chat:
            argv.append("--chat")
        argv += ["--max-new-tokens", str(max_new_tokens), "--metrics-out", str(self.metrics)]
        if host_budget:
            argv += ["--host-budget", host_budget]
        if nvme_path:  # generate takes an existing swap folder only: this one is the compare's, made here
            swap = Path(nvme_path) / f"compare-{tag}"
            swap.mkdir(parents=True, exist_ok=True)
            argv += ["--nvme-path", str(swap)]
        self.proc = children.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.text, self.err = "", ""
        self.laid_out = threading.Event()  # its weights are in place (or it ended): the other side may start
        self._out = threading.Thread(target=self._read_out, daemon=True)
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._out.start()
        self._err.start()

    def _read_out(self):
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := self.proc.stdout.read1(4096):
            self.text += decoder.decode(chunk)
        self.text += decoder.decode(b"", final=True)

    def _read_err(self):
        try:
            for line in iter(self.proc.stderr.readline, b""):
                text = line.decode("utf-8", errors="replace")
                self.err += text
                if LAID_OUT in text:
                    self.laid_out.set()
        finally:
            self.laid_out.set()

    def done(self) -> bool:
        return self.proc.poll() is not None and not self._out.is_alive()

    def summary(self) -> str:
        if not self.done():
            return "generating ..."
        self._err.join(timeout=5)
        if self.proc.returncode != 0:
            return "failed: " + " ".join(self.err.strip().splitlines()[-3:])
        try:
            r = json.loads(self.metrics.read_text())["results"][0]
        except (OSError, json.JSONDecodeError, KeyError, IndexError):
            return "finished (no figures written)"
        return (
            f"{r['new_tokens']} tokens, {r['tokens_per_s']:.2f} tokens/s, first token after "
            f"{r['time_to_first_token_s']:.2f} s" + (" (asked through its chat template)" if self.chat else "")
        )

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()


def side_by_side(
    model_a: str,
    model_b: str,
    prompt: str,
    max_new_tokens: int = 64,
    host_budget: str | None = None,
    nvme_path: str | None = None,
    every_s: float = 0.25,
) -> Iterator[tuple[str, str, str, str]]:
    """Yields (text A, text B, figures A, figures B) as they grow, until both processes have ended."""
    if not prompt.strip():
        raise StudioError("type a prompt first")
    with tempfile.TemporaryDirectory(prefix="aidaptiv-studio-compare-") as tmp:
        # A swap folder of this compare's own (named like its temporary folder), so that two compares at once
        # (two browser tabs) do not meet on one swap space, removed with what a killed side left in it.
        swap = Path(nvme_path) / Path(tmp).name if nvme_path else None
        sides = []
        try:
            sides.append(_Side(model_a, prompt, max_new_tokens, Path(tmp), "a", host_budget, swap))
            while True:
                if len(sides) == 1 and sides[0].laid_out.is_set():
                    sides.append(_Side(model_b, prompt, max_new_tokens, Path(tmp), "b", host_budget, swap))
                finished = len(sides) == 2 and all(s.done() for s in sides)
                b = sides[1] if len(sides) == 2 else None
                waiting = "waiting for the first model's weights to be laid out"
                yield sides[0].text, b.text if b else "", sides[0].summary(), b.summary() if b else waiting
                if finished:
                    return
                time.sleep(every_s)
        finally:
            for s in sides:
                s.kill()
            for s in sides:
                s.proc.wait()
            if swap is not None:
                shutil.rmtree(swap, ignore_errors=True)
