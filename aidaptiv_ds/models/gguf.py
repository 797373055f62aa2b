"""A GGUF file (what llama.cpp, Ollama and LM Studio run) as a Hugging Face model folder the product can train and
run: dequantized once, tensor by tensor, into safetensors shards beside its config, tokenizer, chat template and
generation config, in a cache folder that later uses find again.

Supported: the Llama-shaped architectures this product plans, trains and streams (``SUPPORTED_ARCHITECTURES``:
Llama, which covers SmolLM2 and Llama 3.x, Mistral, Qwen2 and Qwen3), in the float types and the quantisations
gguf-py dequantizes (``SUPPORTED_TYPES``: F32, F16, BF16, Q4_0 to Q8_0 and the k-quants Q2_K to Q6_K). Anything
else is refused by name before a byte is written. The weights come out in the precision the file was made from:
F32, F16 and BF16 files as they are, quantised files in bf16 (their 4 to 8 bits fit bf16's mantissa; the
norms, kept in F32 by llama.cpp, go to bf16 too, as the models were trained).

Memory: one shard of the output (``shard_bytes``, 2 GiB by default) and one tensor in fp32 at a time, however
large the model; names and the attention weights' permutation are transformers' own (its GGUF reader's tensor
processors and name map, used one tensor at a time). The folder is written under a temporary name and renamed
into place, so a conversion cut short is never found as a model; its ``aidaptiv_gguf.json`` says which file,
size and modification time it came from, so an edited GGUF is converted again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Callable, Dict, List, Optional

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
MANIFEST = "aidaptiv_gguf.json"
SHARD_BYTES = 2 << 30


class GGUFError(ValueError):
    """A GGUF file this product cannot take, with what to do about it."""


def cache_root() -> str:
    """Where converted models live: ``$AIDAPTIV_DS_CACHE_DIR/models`` when that is set, else
    ``$XDG_CACHE_HOME/aidaptiv-ds/models`` (``~/.cache`` by default), beside the rates cache."""
    own = os.environ.get("AIDAPTIV_DS_CACHE_DIR")
    if own:
        return os.path.join(own, "models")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aidaptiv-ds", "models")


def _identity(path: str) -> dict:
    st = os.stat(path)
    return {"source": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _folder_for(path: str, root: str) -> str:
    """The cache folder of ``path``: its name and a digest of its identity and first and last MiB (a file
    rewritten in place with the same size and time would still differ there)."""
    ident = _identity(path)
    h = hashlib.sha256(json.dumps(ident, sort_keys=True).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, ident["size"] - (1 << 20)))
        h.update(f.read(1 << 20))
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(root, f"{stem}-{h.hexdigest()[:16]}")


def _field(reader, name: str):
    from transformers.modeling_gguf_pytorch_utils import read_field

    values = read_field(reader, name)
    return values[0] if values else None


def describe(path: str) -> dict:
    """What a GGUF file holds (architecture, name, tensor types), refusing what this product cannot take."""
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file {path} does not exist")
    from aidaptiv_ds.common.extras import missing, missing_message

    if missing("gguf"):
        raise GGUFError(missing_message(f"reading {path}", ["gguf"]))
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture")
    name = _field(reader, "general.name") or os.path.basename(path)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path} holds a {arch!r} model ({name}); this product takes GGUF files of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models: convert the original Hugging Face folder instead"
        )
    unsupported = [t for t in types if t not in SUPPORTED_TYPES]
    if unsupported:
        raise GGUFError(
            f"{path} ({name}) holds tensors in {', '.join(unsupported)}, which this product does not dequantize "
            f"(it takes {', '.join(SUPPORTED_TYPES)}): use a Q4_K_M, Q8_0, F16 or BF16 file of the model"
        )
    return {"reader": reader, "architecture": arch, "name": name, "types": types}


def config_dict(path: str) -> dict:
    """The transformers config of GGUF file ``path`` as a dict, without converting its weights (what ``plan``
    reads); a head with no ``output.weight`` is tied to the embedding."""
    info = describe(path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    config.tie_word_embeddings = "output.weight" not in {t.name for t in info["reader"].tensors}
    return config.to_dict()


def _out_dtype(types: List[str]):
    import torch

    floats = [t for t in types if t in ("F32", "F16", "BF16")]
    if types and len(floats) == len(types):
        # an unquantised file: its own precision (the widest of its tensors)
        return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[
            "F32" if "F32" in floats else "F16" if "F16" in floats else "BF16"
        ]
    return torch.bfloat16


def model_folder(path: str, root: Optional[str] = None, log: Optional[Callable[[str], None]] = None) -> str:
    """The Hugging Face folder of GGUF file ``path``, converting it on first use (see the module's docstring)."""
    root = root or cache_root()
    folder = _folder_for(path, root)
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        return folder
    info = describe(path)
    os.makedirs(root, exist_ok=True)
    staging = f"{folder}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        t0 = time.perf_counter()
        if log:
            log(f"converting {path} ({info['name']}, {', '.join(info['types'])}) into {folder} (once)")
        summary = _convert(path, info, staging, log)
        summary.update(_identity(path), seconds=round(time.perf_counter() - t0, 1))
        with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        try:
            os.rename(staging, folder)
        except OSError:  # another process converted it meanwhile: theirs is as good
            if not os.path.isfile(os.path.join(folder, MANIFEST)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(path: str, info: dict, out: str, log) -> dict:
    import torch
    from gguf import dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    where, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    dtype = _out_dtype(info["types"])
    reader = info["reader"]
    tensor_names = {t.name for t in reader.tensors}
    # llama.cpp writes no output.weight for a head tied to the embedding (SmolLM2, Llama 3.2, Qwen2.5 <= 3B)
    config.tie_word_embeddings = "output.weight" not in tensor_names
    config.dtype = dtype
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(info["architecture"], TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    expected = {n for n, _ in skeleton.named_parameters()}
    shards: List[Dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    written: Dict[str, str] = {}
    files: List[str] = []

    def flush() -> None:
        if not shards[-1]:
            return
        fname = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], os.path.join(out, fname), metadata={"format": "pt"})
        files.append(fname)
        for k in shards[-1]:
            written[k] = fname
        shards[-1], sizes[-1] = {}, 0

    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        weights = dequantize(t.data, t.tensor_type)
        result = processor.process(weights=weights, name=t.name, tensor_key_mapping=names, parsed_parameters={})
        hf_name = names.get(result.name)
        if hf_name is None:
            continue
        tensor = torch.from_numpy(result.weights.copy()).to(dtype)
        shards[-1][hf_name] = tensor
        sizes[-1] += tensor.numel() * tensor.element_size()
        if sizes[-1] >= SHARD_BYTES:
            flush()
        if log and (i + 1) % 50 == 0:
            log(f"dequantized {i + 1}/{total} tensors")
    flush()
    missing = sorted(expected - set(written) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        raise GGUFError(
            f"{path}: {len(missing)} weights of the {info['architecture']} model are not in the file "
            f"(e.g. {', '.join(missing[:3])}): the file is incomplete or of another layout"
        )
    if len(files) == 1:
        os.rename(os.path.join(out, files[0]), os.path.join(out, "model.safetensors"))
        files = ["model.safetensors"]
    else:
        final = {}
        for k, fname in written.items():
            final[k] = fname.replace(".safetensors", f"-of-{len(files):05d}.safetensors")
        for fname in files:
            os.rename(
                os.path.join(out, fname),
                os.path.join(out, fname.replace(".safetensors", f"-of-{len(files):05d}.safetensors")),
            )
        files = sorted(set(final.values()))
        size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": size}, "weight_map": final}, f, indent=1)
    config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    tokenizer.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    if tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    if tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id
    generation.save_pretrained(out)
    return {
        "name": info["name"],
        "architecture": info["architecture"],
        "gguf_types": info["types"],
        "dtype": str(dtype).replace("torch.", ""),
        "tensors": len(written),
        "files": files,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }
