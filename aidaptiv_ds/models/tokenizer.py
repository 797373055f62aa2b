"""Tokenizers: a byte-level one for presets (offline, deterministic), or a local HF model's own (with its chat
template, when it has one: ``has_chat_template``, ``encode_chat`` for training records, ``encode_chat_prompt``
and ``encode_prompt`` for generation).

The byte tokenizer maps UTF-8 bytes 0..255 to ids 0..255 and adds three specials, BOS=256, EOS=257, PAD=258.
Every preset vocabulary (2,048 and up) contains these 259 ids, so the same text gives the same ids for every
preset and nothing has to be downloaded. It is not a good tokenizer for language quality (about one id per
character); it is a fair one for measuring throughput, which counts ids.
"""

from __future__ import annotations

from typing import Dict


class ByteTokenizer:
    """No chat template: records keep the fixed text template of aidaptiv_ds.job.data."""

    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259
    name = "byte"
    has_chat_template = False

    bos_token_id = BOS
    eos_token_id = EOS
    pad_token_id = PAD

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.BOS] if add_bos else []) + ids + ([self.EOS] if add_eos else [])

    def decode(self, ids) -> str:
        """Bytes back to text; specials are dropped, invalid UTF-8 (a cut multi-byte char) is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local HF model's tokenizer, behind the same encode/decode as ByteTokenizer."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.name = getattr(self._tok, "name_or_path", path)
        self.bos_token_id = self._tok.bos_token_id
        self.eos_token_id = self._tok.eos_token_id
        self.pad_token_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_token_id
        self.vocab_size = len(self._tok)
        # A model's chat template is how it will be prompted after fine-tuning, so records are rendered
        # through it when the tokenizer has one (tokenizer_config.json "chat_template", or chat_template.jinja).
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = list(self._tok(text, add_special_tokens=False)["input_ids"])
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The conversation through the chat template (which places BOS and the turn markers itself), then EOS
        unless the template ended on it: documents packed into one stream stay separated."""
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        ids = list(self._tok(text, add_special_tokens=False)["input_ids"])
        if self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
            ids.append(self.eos_token_id)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the tokenizer itself encodes it: its own special tokens where its post-processor puts
        them (a BOS for Llama's, none for SmolLM2's or Qwen's), as transformers' ``tokenizer(text)`` gives."""
        return list(self._tok(text)["input_ids"])

    def encode_chat_prompt(self, messages: list[dict]) -> list[int]:
        """A conversation through the chat template with the assistant's turn opened for the reply, as
        ``apply_chat_template(..., add_generation_prompt=True)`` gives: the template places BOS and the turn
        markers itself, so nothing is added (a second BOS made SmolLM2 answer in French)."""
        if not self.has_chat_template:
            raise ValueError(
                f"the tokenizer of {self.name} has no chat template: give the prompt as plain text (without chat), "
                "or use the model's instruct version"
            )
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def tokenizer_for(spec):
    """The byte tokenizer for presets, the model's own for a local HF directory."""
    if spec.hf_dir is None:
        if spec.config.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"model {spec.name} has vocab_size {spec.config.vocab_size}; the byte tokenizer "
                f"needs at least {ByteTokenizer.vocab_size}"
            )
        return ByteTokenizer()
    return HFTokenizer(spec.hf_dir)


def _bytes_to_unicode() -> Dict[int, str]:
    """The byte -> character table of byte-level BPE (GPT-2's; the one the tokenizers library's ByteLevel
    pre-tokenizer uses): printable bytes stand for themselves, the rest for characters from U+0100 on."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def save_byte_tokenizer(folder: str) -> None:
    """The presets' byte tokenizer (:class:`ByteTokenizer`: UTF-8 bytes are ids 0-255,
    BOS/EOS/PAD 256/257/258) as tokenizer.json and tokenizer_config.json, so that ``AutoTokenizer`` gives the
    ids training saw: a byte-level BPE without merges whose 256 symbols are the bytes in order, and ``<s>``
    before every text, as Llama's tokenizers do. No ``</s>`` is appended: a prompt for ``generate()`` must not
    end the sequence (training records end with EOS because the data pipeline asks ``encode`` for it).
    ``split_special_tokens`` so that a text containing "<s>" is bytes, as for ``encode``, not the special token."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<pad>")])
    bos, eos = ByteTokenizer.BOS, ByteTokenizer.EOS
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    if [tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>")] != [bos, eos, ByteTokenizer.PAD]:
        raise RuntimeError(
            "the byte tokenizer's special ids came out other than 256/257/258: this tokenizers "
            "version numbers added tokens differently; report it"
        )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", split_special_tokens=True
    ).save_pretrained(folder)
