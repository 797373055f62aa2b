"""Generation from a model larger than the host memory given to it: the Python face of ``aidaptiv-ds generate``.

    from aidaptiv_ds.inference import Generator

    with Generator("out/model", host_budget="1GiB", nvme_path="/nvme/swap", kv_cache="/nvme/kv") as gen:
        for r in gen.generate(["Once upon a time"], max_new_tokens=32):
            print(r.text, r.tokens_per_s, r.time_to_first_token_s)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        print(gen.generate([chat])[0].text)  # through the model's chat template, ending at its end of turn

The model is a Hugging Face folder, a hub id, a .gguf file (aidaptiv_ds.models.locate) or a checkpoint of
``aidaptiv-ds train``. A text prompt is encoded as the model's tokenizer encodes it; a conversation (a list of
``{"role", "content"}`` messages) goes through the model's chat template with the assistant's turn opened, and
the reply ends at the tokenizer's end of text or any ``eos_token_id`` of the model's generation config.

The model is built empty from its config.json, its weights (in ``dtype`` when one is asked for; else as stored,
or, when the files mix dtypes, in the config's, as transformers loads them: :func:`load_dtype`) laid out by
:class:`aidaptiv_ds.inference.streamed.StreamedWeights` (resident when they fit ``host_budget``, streamed from
the swap space when not, on CPU with bf16 layers encoded losslessly so that a token reads fewer bytes; on CUDA
resident on the GPU within ``gpu_budget``, default three quarters of the GPU memory free, then in pinned host
memory within ``host_budget``, then from the swap space), and generation is
transformers' own ``generate`` on that model (greedy, or sampled with temperature / top-k / top-p), so the
tokens are those the in-memory model gives.

A mixture-of-experts model that does not fit (on CPU) streams its routed experts apart from their layers
(``experts`` "routed", the default): per step and layer its router runs first, and only the experts it chose
for the step's tokens (their union, for a batch) are read, or found in an expert cache that holds the experts
used most within ``host_budget``; from the model's own safetensors files where they can be read in place (O_DIRECT
over the pages around each expert), else from the swap space (``experts_from``). ``experts`` "whole" streams them
with their layers, as a dense model's. :meth:`Generator.stats` counts the cache's lookups and hits and the bytes
read; each :class:`Result` the bytes its decoding read.

With ``kv_cache`` each prompt runs alone (batch 1): a prompt sharing a prefix with one seen before reads that
prefix's keys and values from :class:`aidaptiv_ds.inference.kv_store.PrefixKVStore` and computes only the rest;
after it, the prompt's own keys and values are stored. Without it prompts run in batches of ``batch_size``
(left-padded), each step streaming the weights once for the whole batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import torch

from aidaptiv_ds.common.sizes import parse_size
from aidaptiv_ds.inference.decode_watch import StepClock, TextStream
from aidaptiv_ds.inference.sources import ModelSourceError, WeightSource, open_source

DEFAULT_KV_CACHE_SIZE = "8GiB"
# Weights in memory: as stored (auto), or converted; the long names are taken too.
DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DEFAULT_KV_HOST_BUDGET = "512MiB"
# Streamed layers stored encoded (weight_codec, lossless), on CPU: auto the bf16 and fp16 ones, on also fp32;
# CUDA reads them as they are.
ENCODE_CHOICES = ("auto", "on", "off")


def _encoded_dtypes(device: str, choice: str) -> tuple:
    from aidaptiv_ds.inference.streamed import ENCODE_ALL, ENCODE_AUTO

    if device != "cpu" or choice == "off":
        return ()
    return ENCODE_ALL if choice == "on" else ENCODE_AUTO


class GenerationError(ValueError):
    """Bad input to generation (a prompt too long, a missing swap path, ...), with what to do."""


@dataclass
class Result:
    """One prompt's completion and how it went."""

    prompt: Union[str, List[dict]]  # a text, or chat messages ({"role", "content"}) through the chat template
    text: str
    token_ids: List[int]
    prompt_tokens: int
    new_tokens: int
    time_to_first_token_s: float
    decode_s: float  # from the first new token to the last
    reused_prefix_tokens: int = 0  # read back from the KV cache instead of computed
    # Weights read from the disk from the first new token to the last (the swap file and the model's files), and
    # the routed experts those steps needed and found in the expert cache: shared by the prompts of one batch.
    decode_bytes_read: int = 0
    decode_expert_lookups: int = 0
    decode_expert_hits: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: new tokens after the first, per second of decoding (0 with fewer than two)."""
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def decode_bytes_per_token(self) -> float:
        """Weights' bytes read from the disk per decoding step (the steps after the first new token)."""
        return self.decode_bytes_read / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    @property
    def decode_expert_hit_rate(self) -> Optional[float]:
        """The share of the routed experts decoding needed that the expert cache held (None: no routed experts)."""
        return self.decode_expert_hits / self.decode_expert_lookups if self.decode_expert_lookups else None


def check_messages(messages) -> List[dict]:
    """Chat messages as the templates take them: a list of {"role": ..., "content": text}."""
    if not isinstance(messages, list) or not messages:
        raise GenerationError("a chat prompt is a non-empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise GenerationError(f'message {i + 1} of a chat prompt is not {{"role": ROLE, "content": TEXT}}: {m!r}')
    return messages


def stop_token_ids(files_dir: str, tokenizer) -> List[int]:
    """The ids that end a reply: the tokenizer's end of text and the model's generation config's
    ``eos_token_id`` (one id or several: Llama 3's instruct models end a turn with <|eot_id|>, which is not
    the tokenizer's EOS), as transformers' generate() stops."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    path = os.path.join(files_dir, "generation_config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return ids


def _tokenizer_identity(files_dir: str) -> str:
    h = hashlib.sha256()
    for f in sorted(os.listdir(files_dir)):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens")) or f.endswith(".model"):
            h.update(f.encode())
            with open(os.path.join(files_dir, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def load_dtype(source: WeightSource, config) -> Optional[torch.dtype]:
    """The dtype the weights are laid out in when none is asked for: None (each tensor as stored) when the
    floating-point tensors share one dtype; when they mix (fp32 norms beside bf16 weights, as some checkpoints
    ship them), the model's one dtype as transformers 5 loads it (``from_pretrained``'s default "auto"): the
    config's ``dtype``, else that of the first floating-point tensor of the first weight file, every
    floating-point tensor converted to it. One dtype, because a layer multiplies its input by its weights and
    torch refuses two dtypes there."""
    floating = [e for e in source.tensors.values() if e.dtype.is_floating_point]
    if len({e.dtype for e in floating}) <= 1:
        return None
    named = getattr(config, "dtype", None)  # transformers 5 reads config.json's "dtype" (or "torch_dtype") here
    if isinstance(named, str):
        named = getattr(torch, named, None)
    if isinstance(named, torch.dtype) and named.is_floating_point:
        return named
    return min(floating, key=lambda e: (e.pieces[0][0], e.name)).dtype


def default_host_budget(weight_bytes: int) -> int:
    """All the weights when they fit half the memory this process may use (its cgroup's limit included),
    else that half."""
    from aidaptiv_ds.engine.machine import total_ram_bytes

    return min(weight_bytes + (64 << 20), max(512 << 20, total_ram_bytes() // 2))


def default_device_budget(device) -> int:
    """Three quarters of the GPU memory this process may still take (free on the device and within its
    per-process fraction, ``--gpu-mem-cap-gb``); the other quarter is left to activations and the KV cache."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    allowed = int(fraction * total) - torch.cuda.memory_reserved(device)
    return max(0, min(free, allowed)) * 3 // 4


def _bytes(host_budget) -> int:
    """A host budget in bytes: a number, or the block's grammar (a size, a share of this process's memory
    such as '25%', '/node' and '/rank' being the same for one process)."""
    if isinstance(host_budget, int):
        return parse_size(host_budget, "`host_budget`")
    from aidaptiv_ds.config.host import budget_bytes

    try:
        return budget_bytes(str(host_budget), None, 1)
    except ValueError as e:
        raise GenerationError(f"`host_budget` {host_budget}: {e}") from None


class Generator:
    """A model ready to generate (see the module's docstring). ``model`` is a Hugging Face folder (safetensors)
    or a checkpoint of ``aidaptiv-ds train``; sizes are bytes or strings such as "1GiB"."""

    def __init__(
        self,
        model: str,
        host_budget=None,
        nvme_path: Optional[str] = None,
        device: Optional[str] = None,
        dtype: Optional[str] = None,
        kv_cache: Optional[str] = None,
        kv_cache_size=DEFAULT_KV_CACHE_SIZE,
        kv_host_budget=DEFAULT_KV_HOST_BUDGET,
        progress: Optional[Callable[[str], None]] = None,
        gpu_budget=None,
        gpu_mem_cap_gb: Optional[float] = None,
        encode_weights: str = "auto",
        experts: str = "routed",
        experts_from: str = "auto",
    ):
        from aidaptiv_ds.models.locate import model_folder
        from aidaptiv_ds.models.presets import PRESETS
        from aidaptiv_ds.models.tokenizer import HFTokenizer

        if model in PRESETS:
            raise ModelSourceError(
                f"`model` {model} is a preset, whose weights are random: generate from a model with weights (a folder, "
                "a hub id, a .gguf file, or a checkpoint or export of a run that trained the preset)"
            )
        if nvme_path is not None:  # before a model is fetched or read: the rule of every swap folder
            from aidaptiv_ds.engine.disk import swap_folder_problem

            problem = swap_folder_problem(nvme_path)
            if problem:
                raise GenerationError(f"`nvme_path` {problem}")
        self.source: WeightSource = open_source(model_folder(model, log=progress))
        self.config = self.source.config()
        try:
            self.tokenizer = HFTokenizer(self.source.files_dir)
        except (OSError, ValueError) as e:
            raise ModelSourceError(
                f"{self.source.files_dir} has no tokenizer transformers can load ({e}): a folder written by "
                "'aidaptiv-ds export' or save_pretrained holds one"
            ) from None
        self.stop_ids = stop_token_ids(self.source.files_dir, self.tokenizer)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = _DTYPE_NAMES.get(dtype, dtype) or "auto"
        if dtype not in DTYPES:
            raise GenerationError(f"`dtype` {dtype}: choose one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[dtype]
        if self.dtype is None:
            self.dtype = load_dtype(self.source, self.config)
        budget = default_host_budget(self.source.nbytes) if host_budget in (None, "auto") else _bytes(host_budget)
        if encode_weights not in ENCODE_CHOICES:
            raise GenerationError(f"`encode_weights` {encode_weights}: choose one of {', '.join(ENCODE_CHOICES)}")
        if encode_weights == "on" and self.device != "cpu":
            raise GenerationError(
                "`encode_weights` on: encoded weights are decoded on the CPU, and on CUDA the layers go to the GPU "
                "as they are read; use `encode_weights` off (or auto) with `device` cuda"
            )
        device_budget = None
        if self.device == "cpu" and (gpu_budget not in (None, "auto") or gpu_mem_cap_gb):
            raise GenerationError("`gpu_budget` and `gpu_mem_cap_gb` are for `device` cuda")
        if self.device != "cpu":
            if not torch.cuda.is_available():
                raise GenerationError(f"`device` {self.device}: this torch sees no GPU; use `device` cpu")
            if gpu_mem_cap_gb:
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_mem_cap_gb * 2**30 / total), self.device)
            device_budget = (
                default_device_budget(self.device)
                if gpu_budget in (None, "auto")
                else parse_size(gpu_budget, "`gpu_budget`")
            )
        from aidaptiv_ds.inference.weight_plan import EXPERT_MODES, EXPERT_SOURCES

        if experts not in EXPERT_MODES:
            raise GenerationError(f"`experts` {experts}: choose one of {', '.join(EXPERT_MODES)}")
        if experts_from not in EXPERT_SOURCES:
            raise GenerationError(f"`experts_from` {experts_from}: choose one of {', '.join(EXPERT_SOURCES)}")
        self.model = self._build_empty()
        from aidaptiv_ds.inference.checkpoint_names import with_model_names
        from aidaptiv_ds.inference.streamed import StreamedWeights

        self.source = with_model_names(self.source, self.model)  # a checkpoint's per-expert tensors, fused

        self.weights = StreamedWeights(
            self.model,
            self.source,
            budget,
            nvme_path,
            device=self.device,
            dtype=self.dtype,
            progress=progress,
            device_budget=device_budget,
            encode=_encoded_dtypes(self.device, encode_weights),
            experts=experts,
            experts_from=experts_from,
        )
        self.weights.attach()
        self.kv = None
        if kv_cache:
            from aidaptiv_ds.inference.kv_store import PrefixKVStore

            try:
                self.kv = PrefixKVStore(
                    kv_cache,
                    self.source.identity,
                    _tokenizer_identity(self.source.files_dir),
                    parse_size(kv_cache_size, "`kv_cache_size`"),
                    parse_size(kv_host_budget, "`kv_host_budget`"),
                    engine=self.weights.engine,
                )
            except BaseException:
                self.close()  # the weights' swap space (and its lock) go now, not when collected
                raise

    def _build_empty(self):
        from accelerate import init_empty_weights

        from aidaptiv_ds.models.presets import _model_class

        with init_empty_weights():
            model = _model_class(self.config)(self.config)
        model.tie_weights()  # tied embeddings share one tensor (transformers ties them at load, not at build)
        model.eval()
        model.requires_grad_(False)
        if self.device != "cpu":
            for module in model.modules():  # buffers are real (rotary frequencies): move them
                for attr, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[attr] = buf.to(self.device)
        return model

    @property
    def max_context(self) -> Optional[int]:
        return getattr(self.config, "max_position_embeddings", None)

    def encode(self, prompt: Union[str, List[dict]]) -> List[int]:
        """A text as the tokenizer itself encodes it, or chat messages through the model's chat template with
        the assistant's turn opened (what transformers' tokenizer and apply_chat_template give)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        try:
            return self.tokenizer.encode_chat_prompt(check_messages(prompt))
        except ValueError as e:
            raise GenerationError(str(e)) from None

    def check_prompts(self, prompts: Sequence[str], max_new_tokens: int) -> List[List[int]]:
        """Token ids of every prompt; GenerationError listing every prompt too long for the model's context."""
        ids = [self.encode(p) for p in prompts]
        limit = self.max_context
        problems = []
        for i, t in enumerate(ids):
            if not t:
                problems.append(f"prompt {i + 1} is empty")
            elif limit and len(t) + max_new_tokens > limit:
                problems.append(
                    f"prompt {i + 1} has {len(t)} tokens; with `max_new_tokens` {max_new_tokens} that is more than "
                    f"the model's context of {limit} tokens"
                )
        if problems:
            raise GenerationError("; ".join(problems) + ": shorten the prompt or ask for fewer new tokens")
        return ids

    def generate(
        self,
        prompts: Sequence[Union[str, List[dict]]],
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        batch_size: int = 8,
        on_text: Optional[Callable[[int, str], None]] = None,
        limits: Optional[Sequence[int]] = None,
        stream_batches: bool = False,
    ) -> List[Result]:
        """Completions of ``prompts`` (texts, or conversations as lists of chat messages), in order; each ends
        at the model's end of text or of its turn (``stop_ids``), or after its own limit of new tokens
        (``limits``, one a prompt; ``max_new_tokens`` by default). ``on_text(i, piece)`` receives prompt i's text
        as it comes: token by token when prompts run one at a time or with ``stream_batches`` (every row of a
        batch, as a server streams its clients' replies), else whole at the end of a batch."""
        if max_new_tokens < 1:
            raise GenerationError(f"`max_new_tokens` {max_new_tokens}: ask for at least one token")
        limits = list(limits) if limits is not None else [max_new_tokens] * len(prompts)
        if len(limits) != len(prompts) or any(not 1 <= n <= max_new_tokens for n in limits):
            raise GenerationError(f"`limits`: one per prompt, each from 1 to `max_new_tokens` {max_new_tokens}")
        ids = self.check_prompts(prompts, max(limits))
        if seed is not None:
            torch.manual_seed(seed)
        sampling = dict(do_sample=do_sample)
        if do_sample:
            sampling.update(temperature=temperature, top_k=top_k or None, top_p=top_p)
        results: List[Result] = []
        step = 1 if (self.kv is not None or batch_size <= 1) else batch_size
        for first in range(0, len(ids), step):
            batch = list(range(first, min(first + step, len(ids))))
            stream = on_text is not None and (len(batch) == 1 or stream_batches)
            results.extend(self._run(prompts, ids, batch, [limits[i] for i in batch], sampling, on_text, stream))
        return results

    def _run(self, prompts, ids, batch, limits, sampling, on_text, stream) -> List[Result]:
        from transformers import DynamicCache, GenerationConfig, LogitsProcessorList

        tok = self.tokenizer
        start = time.perf_counter()
        cache, reused = None, 0
        if self.kv is not None:
            hit = self.kv.lookup(ids[batch[0]])
            if hit is not None:
                reused, layers = hit
                cache = DynamicCache(config=self.config)
                for i, (k, v) in enumerate(layers):
                    cache.update(k.to(self.device), v.to(self.device), i)
        width = max(len(ids[i]) for i in batch)
        input_ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            input_ids[row, width - len(ids[i]) :] = torch.tensor(ids[i])
            mask[row, width - len(ids[i]) :] = 1
        clock = StepClock(self.weights.stats)
        streamer = None
        if stream:
            streamer = TextStream(tok, lambda row, piece: on_text(batch[row], piece), limits, self.stop_ids)
        config = GenerationConfig(
            max_new_tokens=max(limits),
            pad_token_id=tok.pad_token_id,
            eos_token_id=self.stop_ids or None,
            bos_token_id=tok.bos_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            **sampling,
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
                logits_processor=LogitsProcessorList([clock]),
                streamer=streamer,
                past_key_values=cache,
            )
        results = []
        first_token = (clock.times[0] - start) if clock.times else float("nan")
        decode = (clock.times[-1] - clock.times[0]) if len(clock.times) > 1 else 0.0
        decoded = clock.decoded()
        for row, i in enumerate(batch):
            new = out.sequences[row, width:].tolist()[: limits[row]]
            ends = [k for k, t in enumerate(new) if t in self.stop_ids]
            if ends:
                new = new[: ends[0] + 1]
            text = tok.decode(new)
            if on_text and streamer is None:
                on_text(i, text)
            results.append(
                Result(
                    prompts[i], text, new, len(ids[i]), len(new), first_token, decode, reused if row == 0 else 0,
                    *decoded,
                )
            )  # fmt: skip
        if self.kv is not None and reused < len(ids[batch[0]]) - 1:
            self._store_prefix(ids[batch[0]], out.past_key_values)
        return results

    def _store_prefix(self, prompt_ids: List[int], cache) -> None:
        n = len(prompt_ids) - 1
        layers = [(layer.keys[:, :, :n].cpu(), layer.values[:, :, :n].cpu()) for layer in cache.layers]
        self.kv.save(prompt_ids[:n], layers)

    def stats(self) -> dict:
        """What moved: the weights' streaming counters, their split, and the KV cache's counters."""
        w = self.weights
        out = dict(w.stats)
        out.update(
            weight_bytes=self.source.nbytes,
            resident_bytes=w.resident_bytes,
            streamed_bytes_per_pass=w.streamed_bytes,
            streamed_weight_bytes_per_pass=w.streamed_weight_bytes,
            in_host_bytes_per_pass=w.in_host_bytes,
            device_budget=w.device_budget,
            by_rows_bytes=w.by_rows_bytes,
            slots=w.slot_count,
            slot_bytes=w.slot_bytes,
            host_budget=w.host_budget,
            device=str(self.device),
        )
        if w.expert_sets or w.experts_note:
            out["experts"] = self._expert_stats()
        if self.kv is not None:
            out["kv_cache"] = dict(self.kv.stats)
        return out

    def _expert_stats(self) -> dict:
        """How the routed experts are read, and what the expert cache did (hits: experts a step needed that it
        held; the rest were read)."""
        w = self.weights
        sets = w.expert_sets
        st = w.stats
        lookups = st.get("expert_lookups", 0)
        where = sorted({"model" if s.in_place else "swap" for s in sets})
        return dict(
            mode="routed" if sets else "whole",
            note=w.experts_note,
            layers=len(sets),
            experts=sum(s.num_experts for s in sets),
            top_k=max((s.top_k for s in sets), default=0),
            read_from="+".join(where),
            weight_bytes=w.expert_bytes,
            active_bytes_per_token=w.active_expert_bytes,
            cache_slots=w.expert_slots,
            slot_bytes=w.expert_slot_bytes,
            lookups=lookups,
            hits=st.get("expert_hits", 0),
            hit_rate=st.get("expert_hits", 0) / lookups if lookups else None,
            reads=st.get("expert_reads", 0),
            bytes_read=st.get("expert_bytes_read", 0),
            bytes_moved=st.get("expert_bytes_moved", 0),
            steps_pipelined=st.get("expert_steps_pipelined", 0),
            wait_s=st.get("expert_wait_s", 0.0),
        )

    def close(self) -> None:
        if self.kv is not None:
            self.kv.engine = None  # the weights' engine: closed with them
            self.kv = None
        if getattr(self, "weights", None) is not None:
            self.weights.close()
            self.weights = None

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
