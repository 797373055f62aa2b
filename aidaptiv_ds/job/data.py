"""Instruction data: records -> one training text each -> token stream -> packed fixed-length sequences.

Records come from a JSONL, JSON, CSV or Parquet file or a datasets save_to_disk folder (aidaptiv_ds.job.record_files
reads them). Accepted record shapes:

- Dolly:   {"instruction", "context", "response"}   (context may be empty)
- Alpaca:  {"instruction", "input", "output"}       (input may be empty)
- pair:    {"prompt", "response"}
- chat:    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
- text:    {"text"}   (a passage for continued training, as the studio makes from documents: its text as it
  is, framed by BOS/EOS, never through a template)

Every record becomes one text with a fixed template (TEMPLATE below), framed by BOS/EOS; with a tokenizer that
has a chat template (a Hugging Face model directory whose tokenizer_config.json carries ``chat_template``), the
record becomes chat messages instead (``record_messages``: instruction and input as the user's turn, the
response as the assistant's) rendered by that template, as the model will be prompted after fine-tuning. The
texts of one
epoch, in an order shuffled from the seed, are concatenated into one token stream, and the stream is cut into
sequences of exactly ``seq_len`` tokens (packing): no padding, so every token trains and tokens/s compares
across runs. Labels are the input ids (causal LM; the model shifts them). The stream repeats with a fresh
order each epoch, so any number of steps at any sequence length can be served from a small file.

Sharding: global micro-batch ``g`` holds sequences ``g*B .. g*B+B-1``; rank ``r`` of ``W`` takes micro-batches
``r, r+W, r+2W, ...``. All ranks together consume the stream in order, so the data of one step with 2 ranks
x B equals one rank x 2B, and a position (a micro-batch counter) is all a checkpoint needs to resume.

Held-out evaluation (``split_held_out``): a fraction of the records, picked from the seed, is taken out of the
training stream before packing; ``EvalBatches`` packs those records once, in file order, into whole sequences
of ``seq_len`` (the tail shorter than one sequence is left out) and shards them over the ranks.
"""

from __future__ import annotations

import math
import os
import random

from aidaptiv_ds.job.record_files import DataError, read_records

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "instructions.jsonl")

TEMPLATE = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n{response}"
INPUT_BLOCK = "### Input:\n{input}\n\n"
CHAT_ROLES = ("system", "user", "assistant")


def _text_field(rec: dict, key: str, where: str, required: bool = True) -> str:
    value = rec.get(key)
    if value is None and not required:  # absent, or null in a Parquet/datasets column
        return ""
    if value is None:
        raise DataError(f"{where}: field {key!r} is missing")
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _chat(rec: dict, where: str) -> list[dict]:
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
        if m["role"] not in CHAT_ROLES:
            raise DataError(f"{where}: messages[{i}] has role {m['role']!r}; expected one of {', '.join(CHAT_ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _instruction_fields(rec: dict, where: str) -> tuple[str, str, str]:
    """(instruction, input or context, response) of a Dolly, Alpaca or prompt/response record."""
    if "instruction" in rec and "response" in rec:  # Dolly
        instruction, extra, response = (
            _text_field(rec, "instruction", where),
            _text_field(rec, "context", where, required=False),
            _text_field(rec, "response", where),
        )
    elif "instruction" in rec and "output" in rec:  # Alpaca
        instruction, extra, response = (
            _text_field(rec, "instruction", where),
            _text_field(rec, "input", where, required=False),
            _text_field(rec, "output", where),
        )
    elif "prompt" in rec and "response" in rec:
        instruction, extra, response = _text_field(rec, "prompt", where), "", _text_field(rec, "response", where)
    else:
        raise DataError(
            f"{where}: unrecognised record with keys {sorted(rec)}; expected instruction/context/"
            "response (Dolly), instruction/input/output (Alpaca), prompt/response, messages, or text"
        )
    return instruction, extra, response


def _check_object(rec, where: str) -> None:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")


def _is_text(rec: dict) -> bool:
    """A plain passage: a "text" field and none of the instruction or chat shapes' keys."""
    return "text" in rec and not ({"messages", "instruction", "prompt"} & rec.keys())


def format_record(rec, where: str = "record") -> str:
    """One training text from one record of any accepted shape (the fixed template, no chat template)."""
    _check_object(rec, where)
    if _is_text(rec):
        return _text_field(rec, "text", where)
    if "messages" in rec:
        return "\n\n".join(f"### {m['role'].capitalize()}:\n{m['content']}" for m in _chat(rec, where))
    instruction, extra, response = _instruction_fields(rec, where)
    input_block = INPUT_BLOCK.format(input=extra) if extra.strip() else ""
    return TEMPLATE.format(instruction=instruction, input_block=input_block, response=response)


def record_messages(rec, where: str = "record") -> list[dict]:
    """The record as chat messages, for a tokenizer's chat template: a chat record as it is; an instruction
    record as the user's turn (the instruction, then its input or context after a blank line) and the
    assistant's reply."""
    _check_object(rec, where)
    if "messages" in rec:
        return _chat(rec, where)
    instruction, extra, response = _instruction_fields(rec, where)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": response}]


def record_tokens(rec, tokenizer, where: str = "record") -> list[int]:
    """One record's token ids: through the tokenizer's chat template when it has one, else the fixed
    template framed by BOS/EOS; a text record's passage as it is, framed by BOS/EOS."""
    if _is_text(rec):
        return tokenizer.encode(format_record(rec, where))
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.encode_chat(record_messages(rec, where))
    return tokenizer.encode(format_record(rec, where))


def load_records(path: str) -> list[tuple[str, dict]]:
    """Every record of a data file or folder (any form aidaptiv_ds.job.record_files reads) as (where, record)."""
    return read_records(path)


def load_texts(path: str) -> list[str]:
    """All records of a data file as training texts (fixed template); the first malformed one raises DataError."""
    return [format_record(rec, where) for where, rec in read_records(path)]


def split_held_out(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): ``fraction`` of the records (at least one, and at least one left to train on), picked
    from ``seed``; both parts keep the file's order."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"`eval_fraction` {fraction} must be at least 0 and below 1")
    if fraction == 0.0:
        return list(records), []
    n_eval = max(1, round(fraction * len(records)))
    if n_eval >= len(records):
        raise DataError(
            f"`eval_fraction` {fraction} of {len(records)} record(s) leaves nothing to train on: lower "
            "it, give more data, or pass the held-out set as `eval_data`"
        )
    order = list(range(len(records)))
    # Its own generator, not the packing's, so that the split does not move when the packing changes.
    random.Random(seed * 1_000_033 + 7).shuffle(order)
    held = set(order[:n_eval])
    return ([r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held])


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
            pieces.append(self._epoch(e)[off : off + take])
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


class EvalBatches:
    """The held-out records packed once, in order, into whole sequences of ``seq_len``, sharded like
    ShardedBatches. Every rank runs the same number of forwards (``rounds``; ZeRO-3 gathers parameters
    collectively): a rank without a batch in the last round re-runs the first one with weight 0."""

    def __init__(
        self,
        token_lists: list[list[int]],
        seq_len: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        what: str = "the held-out data",
    ):
        import torch

        ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int64)
        self.sequences = len(ids) // seq_len
        if self.sequences == 0:
            raise DataError(
                f"{what} has {len(ids)} tokens, fewer than one sequence of `seq_len` {seq_len}: give "
                "more held-out records (a larger `eval_fraction` or `eval_data` file) or a shorter "
                "`seq_len`"
            )
        self.tokens = self.sequences * seq_len
        self._ids = ids[: self.tokens].view(self.sequences, seq_len)
        self.micro_batch, self.rank, self.world_size = micro_batch, rank, world_size
        global_batches = math.ceil(self.sequences / micro_batch)
        self.rounds = math.ceil(global_batches / world_size)

    def batch(self, i: int) -> tuple[dict, int]:
        """This rank's batch of round ``i`` and how many of its sequences count (0 for a stand-in)."""
        g = i * self.world_size + self.rank
        start = g * self.micro_batch
        if start >= self.sequences:
            ids, weight = self._ids[: min(self.micro_batch, self.sequences)], 0
        else:
            ids = self._ids[start : start + self.micro_batch]
            weight = len(ids)
        return {"input_ids": ids.clone(), "labels": ids.clone()}, weight


def tokenize(records: list, tokenizer) -> list[list[int]]:
    return [record_tokens(rec, tokenizer, where) for where, rec in records]


def build_batches(
    path: str, tokenizer, seq_len: int, micro_batch: int, seed: int, rank: int, world_size: int
) -> ShardedBatches:
    stream = PackedStream(tokenize(read_records(path), tokenizer), seq_len, seed)
    return ShardedBatches(stream, micro_batch, rank, world_size)
