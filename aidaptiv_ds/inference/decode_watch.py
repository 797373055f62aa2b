"""What `generate` watches while transformers decodes: :class:`StepClock`, a logits processor that notes when each
new token's logits are ready and the weights' read counters then, and :class:`TextStream`, transformers' streamer
protocol turned into text pieces per row of a batch."""

from __future__ import annotations

import time
from typing import Callable, List


class StepClock:
    """A logits processor that only notes when each new token's logits are ready, and the weights' read counters
    then (it changes nothing)."""

    _COUNTERS = ("bytes_read", "expert_lookups", "expert_hits")

    def __init__(self, stats: dict):
        self.stats = stats
        self.times: List[float] = []
        self.counters: List[tuple] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        self.counters.append(tuple(self.stats.get(k, 0) for k in self._COUNTERS))
        return scores

    def decoded(self) -> tuple:
        """(bytes read, expert lookups, expert hits) from the first new token to the last."""
        if len(self.counters) < 2:
            return (0, 0, 0)
        return tuple(b - a for a, b in zip(self.counters[0], self.counters[-1]))


class TextStream:
    """transformers' streamer protocol (put, end) turned into text pieces for ``on_text(row, piece)``, for every
    row of a batch: the first put is the prompts (skipped), then one token a row each step; a row's text is
    given when it decodes whole (no cut UTF-8), and ends after its own limit of new tokens or a stop id (later
    tokens of that row are the batch running on for the others)."""

    def __init__(self, tokenizer, on_text: Callable[[int, str], None], limits: List[int], stop_ids: List[int]):
        self.tokenizer, self.on_text, self.limits, self.stop_ids = tokenizer, on_text, limits, set(stop_ids)
        self.ids: List[List[int]] = [[] for _ in limits]
        self.shown = [0] * len(limits)
        self.done = [False] * len(limits)
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for row, token in enumerate(value.reshape(len(self.limits), -1)[:, -1].tolist()):
            if self.done[row]:
                continue
            self.ids[row].append(int(token))
            if int(token) in self.stop_ids or len(self.ids[row]) >= self.limits[row]:
                self.done[row] = True
            self._show(row)

    def _show(self, row: int, final: bool = False) -> None:
        text = self.tokenizer.decode(self.ids[row])
        if text.endswith("\ufffd") and not final:
            return  # a character cut between tokens: wait for the rest
        if len(text) > self.shown[row]:
            self.on_text(row, text[self.shown[row] :])
            self.shown[row] = len(text)

    def end(self):
        for row in range(len(self.limits)):
            self._show(row, final=True)
