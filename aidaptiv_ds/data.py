"""Instruction data: JSONL records -> one training text each -> token stream -> packed fixed-length sequences.

Accepted record shapes (one JSON object per line; blank lines are skipped):

- Dolly:   {"instruction", "context", "response"}   (context may be empty)
- Alpaca:  {"instruction", "input", "output"}       (input may be empty)
- pair:    {"prompt", "response"}
- chat:    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

Every record becomes one text with a fixed template (TEMPLATE below), framed by BOS/EOS. The texts of one
epoch, in an order shuffled from the seed, are concatenated into one token stream, and the stream is cut into
sequences of exactly ``seq_len`` tokens (packing): no padding, so every token trains and tokens/s compares
across runs. Labels are the input ids (causal LM; the model shifts them). The stream repeats with a fresh
order each epoch, so any number of steps at any sequence length can be served from a small file.

Sharding: global micro-batch ``g`` holds sequences ``g*B .. g*B+B-1``; rank ``r`` of ``W`` takes micro-batches
``r, r+W, r+2W, ...``. All ranks together consume the stream in order, so the data of one step with 2 ranks
x B equals one rank x 2B, and a position (a micro-batch counter) is all a checkpoint needs to resume.
"""
from __future__ import annotations

import json
import os
import random

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "instructions.jsonl")

TEMPLATE = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n{response}"
INPUT_BLOCK = "### Input:\n{input}\n\n"
CHAT_ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """A malformed data file; the message names the file and line."""


def _text_field(rec: dict, key: str, where: str, required: bool = True) -> str:
    value = rec.get(key, "" if not required else None)
    if value is None:
        raise DataError(f"{where}: field {key!r} is missing")
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def format_record(rec, where: str = "record") -> str:
    """One training text from one record of any accepted shape."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        parts = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
            if m["role"] not in CHAT_ROLES:
                raise DataError(f"{where}: messages[{i}] has role {m['role']!r}; expected one of {', '.join(CHAT_ROLES)}")
            parts.append(f"### {m['role'].capitalize()}:\n{m['content']}")
        return "\n\n".join(parts)
    if "instruction" in rec and "response" in rec:           # Dolly
        instruction, extra, response = (_text_field(rec, "instruction", where),
                                        _text_field(rec, "context", where, required=False),
                                        _text_field(rec, "response", where))
    elif "instruction" in rec and "output" in rec:           # Alpaca
        instruction, extra, response = (_text_field(rec, "instruction", where),
                                        _text_field(rec, "input", where, required=False),
                                        _text_field(rec, "output", where))
    elif "prompt" in rec and "response" in rec:
        instruction, extra, response = _text_field(rec, "prompt", where), "", _text_field(rec, "response", where)
    else:
        raise DataError(f"{where}: unrecognised record with keys {sorted(rec)}; expected instruction/context/"
                        "response (Dolly), instruction/input/output (Alpaca), prompt/response, or messages")
    input_block = INPUT_BLOCK.format(input=extra) if extra.strip() else ""
    return TEMPLATE.format(instruction=instruction, input_block=input_block, response=response)


def load_texts(path: str) -> list[str]:
    """All records of a JSONL file as training texts; the first malformed line raises DataError."""
    if not os.path.isfile(path):
        raise DataError(f"data file {path} does not exist: give a JSONL file of instruction records")
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            texts.append(format_record(rec, where))
    if not texts:
        raise DataError(f"data file {path} has no records")
    return texts


class PackedStream:
    """Fixed-length token sequences cut from the endless, per-epoch shuffled stream of tokenised texts."""

    def __init__(self, token_lists: list[list[int]], seq_len: int, seed: int):
        import torch
        if seq_len < 2:
            raise ValueError(f"seq_len {seq_len} is too short: need at least 2 tokens per sequence")
        self.seq_len = seq_len
        self.seed = seed
        self._docs = [torch.tensor(t, dtype=torch.int32) for t in token_lists if len(t)]
        if not self._docs:
            raise DataError("the data has no tokens")
        self.epoch_tokens = sum(len(d) for d in self._docs)
        self._cache: dict[int, object] = {}

    def _epoch(self, e: int):
        import torch
        if e not in self._cache:
            order = list(range(len(self._docs)))
            random.Random(self.seed * 1_000_003 + e).shuffle(order)
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[e] = torch.cat([self._docs[i] for i in order])
        return self._cache[e]

    def sequence(self, k: int):
        """Sequence ``k`` of the stream (int64 tensor of seq_len ids)."""
        import torch
        start, end = k * self.seq_len, (k + 1) * self.seq_len
        pieces = []
        while start < end:
            e, off = divmod(start, self.epoch_tokens)
            take = min(end - start, self.epoch_tokens - off)
            pieces.append(self._epoch(e)[off:off + take])
            start += take
        return torch.cat(pieces).to(torch.int64)


class ShardedBatches:
    """This rank's micro-batches: ``batch(m)`` is its m-th, as {input_ids, labels} of shape [B, seq_len]."""

    def __init__(self, stream: PackedStream, micro_batch: int, rank: int, world_size: int):
        if micro_batch < 1:
            raise ValueError(f"micro_batch {micro_batch} must be at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.stream, self.micro_batch, self.rank, self.world_size = stream, micro_batch, rank, world_size

    def global_index(self, m: int) -> int:
        return m * self.world_size + self.rank

    def batch(self, m: int) -> dict:
        import torch
        g = self.global_index(m)
        ids = torch.stack([self.stream.sequence(g * self.micro_batch + j) for j in range(self.micro_batch)])
        return {"input_ids": ids, "labels": ids.clone()}


def build_batches(path: str, tokenizer, seq_len: int, micro_batch: int, seed: int, rank: int,
                  world_size: int) -> ShardedBatches:
    texts = load_texts(path)
    stream = PackedStream([tokenizer.encode(t) for t in texts], seq_len, seed)
    return ShardedBatches(stream, micro_batch, rank, world_size)
