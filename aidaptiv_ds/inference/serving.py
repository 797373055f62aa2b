"""Requests from many clients, answered by one model: a queue and the one thread that owns the
:class:`~aidaptiv_ds.inference.generate.Generator` (its streamed weights, its prompt cache).

Requests that arrive together are decoded together: the worker takes the first waiting request, waits up to
``wait_s`` for more, and runs up to ``max_batch`` of those that sample alike (greedy ones together; sampled ones
with the same temperature and top-p; one with a seed alone, so its seed means what it says) as one batch, so the
weights stream once a step for all of them. Each reply streams to its client token by token as the batch runs,
and ends at its own token limit or the model's end of turn. A request is checked when it is submitted (its
prompt encodes and fits the model's context), so one bad request never fails a batch.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from aidaptiv_ds.inference.openai_api import APIError, Ask


@dataclass
class Job:
    """One request in flight: its checked ask, its prompt's tokens, and what the worker says back (``events``:
    ("piece", text) as the reply grows, then ("done", Result) or ("error", APIError))."""

    ask: Ask
    prompt_tokens: int
    events: "queue.Queue" = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.perf_counter)

    def sampling(self) -> tuple:
        a = self.ask
        return ("greedy",) if a.greedy else ("sample", a.temperature, a.top_p, a.seed)


class ServingQueue:
    """Submit checked requests; one worker thread batches and answers them (see the module's docstring)."""

    def __init__(
        self, generator, max_batch: int = 8, wait_s: float = 0.02, log: Optional[Callable[[str], None]] = None
    ):
        self.generator, self.max_batch, self.wait_s, self.log = generator, max(1, max_batch), wait_s, log
        self.waiting: "queue.Queue[Job]" = queue.Queue()
        self.stats = {"requests": 0, "batches": 0, "largest_batch": 0, "tokens": 0}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="aidaptiv-serve-worker", daemon=True)
        self._thread.start()

    def submit(self, ask: Ask) -> Job:
        """A job for ``ask``, queued; APIError (400) when its prompt cannot be generated from."""
        gen = self.generator
        if ask.chat and not getattr(gen.tokenizer, "has_chat_template", False):
            raise APIError(400, "this model has no chat template: send the text to /v1/completions", "messages")
        try:
            ids = gen.check_prompts([ask.prompt], ask.max_tokens)[0]
        except ValueError as e:
            raise APIError(400, str(e).replace("`", ""), "messages" if ask.chat else "prompt") from None
        job = Job(ask, len(ids))
        self.waiting.put(job)
        return job

    def close(self) -> None:
        self._stopping.set()
        self.waiting.put(None)  # wakes the worker
        self._thread.join(timeout=60)

    def _batch(self) -> List[Job]:
        first = self.waiting.get()
        if first is None:
            return []
        jobs, held = [first], []
        deadline = time.perf_counter() + self.wait_s
        while len(jobs) < self.max_batch and first.ask.seed is None:
            try:
                job = self.waiting.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if job is None:
                self._stopping.set()
                break
            (jobs if job.sampling() == first.sampling() and job.ask.seed is None else held).append(job)
        for job in held:  # another sampling: the next batch takes it, first in line
            self.waiting.put(job)
        return jobs

    def _work(self) -> None:
        while not self._stopping.is_set():
            jobs = self._batch()
            if not jobs:
                continue
            a = jobs[0].ask
            try:
                results = self.generator.generate(
                    [j.ask.prompt for j in jobs],
                    max_new_tokens=max(j.ask.max_tokens for j in jobs),
                    limits=[j.ask.max_tokens for j in jobs],
                    do_sample=not a.greedy,
                    temperature=a.temperature if not a.greedy else 1.0,
                    top_p=a.top_p,
                    seed=a.seed,
                    batch_size=len(jobs),
                    on_text=lambda i, piece: jobs[i].events.put(("piece", piece)),
                    stream_batches=True,
                )
            except Exception as e:  # noqa: BLE001 - every client of the batch hears why, the server goes on
                error = APIError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error")
                for j in jobs:
                    j.events.put(("error", error))
                if self.log:
                    self.log(f"a batch of {len(jobs)} failed: {type(e).__name__}: {e}")
                continue
            self.stats["requests"] += len(jobs)
            self.stats["batches"] += 1
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(jobs))
            for j, r in zip(jobs, results):
                self.stats["tokens"] += r.new_tokens
                j.events.put(("done", r))
