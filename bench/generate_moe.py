#!/usr/bin/env python3
"""Generation from a mixture-of-experts model several times larger than the memory given to it: `aidaptiv-ds
generate` reading only the routed experts (from the model's files, and, as a variant, from the swap file)
against our own dense streaming of the same model (--experts whole: every expert with its layer, every step) and
accelerate's disk offload (``from_pretrained(device_map="auto", max_memory=..., offload_folder=...)``), in one
run (issue 42's targets: >= 4x our dense streaming, >= 10x accelerate, bytes read per token within 1.3x of the
bound).

Model: OLMoE-1B-7B's published shape (allenai/OLMoE-1B-7B-0924: hidden 2048, 16 layers, 16 heads, 64 experts of
intermediate 1024, 8 a token, vocabulary 50304, untied; 6.9 B parameters, 1.3 B active, 13.8 GB in bf16) built
from transformers' own OlmoeConfig, with random weights written tensor by tensor as transformers saves the model
(one tensor per expert, as the published checkpoint), so the model is never whole in memory. ``--shape
olmoe-mini`` is a small one of the same family for validation runs.

Routers: random weights route about uniformly, the worst case for any expert cache (every expert equally likely,
each step's experts independent of the last). ``--routers zipf`` also measures routers skewed as trained ones
are: the MoE block's router still computes its logits, but each token's experts are drawn without replacement
from a Zipf distribution over a fixed random order of the layer's experts (expert of rank r has weight
1 / r^s, s = ``--zipf-s``, 1.0 by default: an assumption, not a measured router; trained routers are skewed,
with a load-balancing loss that keeps them from collapsing), from a generator seeded per layer, so every side
sees the same choices; the chosen experts' weights are the router's softmax renormalised over them. Patched into
each side's process before the model is built (the router classes ending in ``TopKRouter``).

Conditions as bench/generate_offload.py: every side gets the same host budget for weights (ours --host-budget;
accelerate max_memory={"cpu": budget}) and runs in a memory cgroup of ``--cap-gib`` (page cache charged); the
weight files' and offload folder's pages are dropped before every run; sides interleaved, their order reversed
every other repeat; greedy decoding of one prompt. Measured in the same run: the in-memory model (no cap, unless
``--no-in-memory``) for the reference tokens and the compute bound, and the disk's O_DIRECT read rate (io-bench).

Bytes read per token: ours, what its engine read between the first new token and the last, per token (Result's
``decode_bytes_per_token``: the experts it missed in its cache, and any streamed layer); the bound, the bytes of
the experts the decoding steps needed that the cache did not hold (its hits taken off) plus the layers its plan
streams each step; the active bytes (every expert a token uses, no cache) beside it.

    python bench/generate_moe.py --shape olmoe-1b-7b --budget 2GiB --cap-gib 4 --repeats 3 --routers uniform,zipf
    python bench/generate_moe.py --shape olmoe-mini --budget 160MiB --cap-gib 1.5 --repeats 1   # validation

``--before REV`` adds the routed side as it was at commit REV (run from a worktree of it, interleaved with the
others): a change to the routed path measured against its predecessor in the same run.

Writes one JSON row per run to OUT/rows.jsonl and the medians to OUT/summary.md.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)  # generate_offload beside it, also when this file is loaded by a test

from generate_offload import ACCELERATE_CHILD, TIMED_GENERATE, disk_read_gbps, drop_page_cache  # noqa: E402
from step_regression import baseline_tree  # noqa: E402

from aidaptiv_ds.common.sizes import format_size, parse_size  # noqa: E402
from aidaptiv_ds.harness.hostcap import probe_cgroup  # noqa: E402
from aidaptiv_ds.harness.machine import machine_info, summary  # noqa: E402

THREADS = os.cpu_count()  # OpenMP threads of every side (--threads)


def git_sha() -> str:
    """This checkout's commit (not that of an aidaptiv_ds imported from elsewhere, as an editable install's
    autoload may have done before this file put its checkout first)."""
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True)
    return out.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "")


def run_capped(cmd, cap_bytes, factory, name, tree=ROOT):
    """``cmd`` in a fresh memory cgroup of ``cap_bytes`` (none when 0 or None), this checkout first on its path:
    (returncode, stdout, stderr, peak bytes, oom kills)."""
    cg = factory.create(f"aidaptiv-moe-bench-{os.getpid()}-{name}", cap_bytes) if factory and cap_bytes else None
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS=str(THREADS))
    try:
        p = subprocess.run(cg.wrap(cmd) if cg else cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        peak = cg.peak_bytes() if cg else None
        ooms = cg.oom_kills() if cg else 0
    finally:
        if cg:
            cg.remove()
    return p.returncode, p.stdout, p.stderr, peak, ooms


# OLMoE-1B-7B's published config (allenai/OLMoE-1B-7B-0924, config.json), and a small one of the same family.
# The presets (aidaptiv_ds/models/presets.py) are to replace these once they hold MoE shapes.
SHAPES = {
    "olmoe-1b-7b": dict(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False, norm_topk_prob=False,
        clip_qkv=None, rms_norm_eps=1e-5,
    ),
    "olmoe-mini": dict(
        hidden_size=512, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        num_experts=64, num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
# Or any mixture-of-experts preset (aidaptiv_ds/models/presets.py: qwen3-30b-a3b, gpt-oss-20b, ...), its config
# from preset_config: the shapes of the larger published models.


def moe_presets() -> list:
    from aidaptiv_ds.models.presets import MOE_FAMILIES, PRESETS

    return [n for n, p in PRESETS.items() if p["family"] in MOE_FAMILIES and n not in SHAPES]


def shape_config(shape: str) -> dict:
    """The config's fields this bench writes for ``shape`` (what its rows record)."""
    if shape in SHAPES:
        return dict(SHAPES[shape], model_type="olmoe")
    from aidaptiv_ds.models.presets import preset_config

    return preset_config(shape).to_diff_dict()


SIDES = {
    "aidaptiv": "aidaptiv-ds generate (routed experts, --experts-from auto)",
    "aidaptiv_swap": "aidaptiv-ds generate --experts-from swap",
    "aidaptiv_before": "aidaptiv-ds generate at --before (routed experts, --experts-from auto)",
    "aidaptiv_whole": "aidaptiv-ds generate --experts whole (dense streaming)",
    "accelerate": "accelerate disk offload",
}
# Where `--experts-from auto` read the experts (Generator.stats()["experts"]["read_from"]), said in the summary.
READ_FROM = {
    "model": "the model files (in place)",
    "swap": "the swap file",
    "model+swap": "the model files for some layers and the swap file for the others (auto copies a layer whose "
    "experts it cannot read in place)",
}
# Config fields the summary leaves out (the same for every shape, or transformers' bookkeeping).
CONFIG_NOISE = {"model_type", "transformers_version", "dtype", "architectures", "output_router_logits"}
OURS = {
    "aidaptiv": (),
    "aidaptiv_swap": ("--experts-from", "swap"),
    "aidaptiv_whole": ("--experts", "whole"),
    "aidaptiv_before": (),  # the same command from the --before commit's tree
}
DEFAULT_SIDES = ("aidaptiv", "aidaptiv_whole", "accelerate")
PROMPT = "The history of the printing press begins in the fifteenth century, when"

# Prepended to every side's process: the routers' choices drawn from a Zipf distribution (see the docstring).
ZIPF_ROUTER = r"""
def install_zipf_router(s, seed):
    import importlib, torch, transformers
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(MODEL_DIR)
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    routers = [c for n, c in vars(module).items() if n.endswith("TopKRouter") and isinstance(c, type)]
    drawn = {}

    def patched(original):
        def forward(self, hidden_states):
            logits, scores, index = original(self, hidden_states)
            if id(self) not in drawn:  # layers in the order they first run: the same on every side
                g = torch.Generator().manual_seed(seed + len(drawn))
                order = torch.randperm(self.num_experts, generator=g)
                weight = torch.empty(self.num_experts, dtype=torch.float64)
                weight[order] = 1.0 / torch.arange(1, self.num_experts + 1, dtype=torch.float64) ** s
                drawn[id(self)] = (g, (weight / weight.sum()).float())
            g, p = drawn[id(self)]
            chosen = torch.multinomial(p.expand(index.shape[0], -1), index.shape[1], replacement=False, generator=g)
            chosen = chosen.to(index.device)
            w = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
            return logits, (w / w.sum(dim=-1, keepdim=True)).to(scores.dtype), chosen
        return forward

    for c in routers:
        c.forward = patched(c.forward)
"""

OURS_CHILD = r"""
import sys
if ZIPF_S > 0:
    install_zipf_router(ZIPF_S, 1234)
from aidaptiv_ds.cli import main
sys.exit(main(sys.argv[1:]))
"""


def write_model(shape: str, dtype: str, folder: str) -> str:
    """A random-weight folder of ``shape`` (OLMoE's, or a preset's), written tensor by tensor (kept between runs)."""
    stamp = os.path.join(folder, "bench-stamp.json")
    want = {"shape": shape, "dtype": dtype, "config": shape_config(shape), "writer": 1}
    if os.path.exists(stamp) and json.load(open(stamp)) == want:
        return folder
    code = f"""
import json, os, struct, sys, torch
sys.path.insert(0, {ROOT!r})
from transformers import OlmoeConfig, AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion
from aidaptiv_ds.models.presets import preset_config
from aidaptiv_ds.models.tokenizer import save_byte_tokenizer
folder, dtype = {folder!r}, getattr(torch, {dtype!r})
os.makedirs(folder, exist_ok=True)
if {shape in SHAPES!r}:
    config = OlmoeConfig(**{SHAPES.get(shape)!r}, bos_token_id=256, eos_token_id=257, pad_token_id=258)
else:
    config = preset_config({shape!r})
config.dtype = dtype
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
# The names and shapes transformers saves (one tensor per expert), from the model on the meta device.
saved = revert_weight_conversion(model, model.state_dict())
names = sorted(saved)
shards, size = [[]], 0
for n in names:
    nbytes = saved[n].numel() * dtype.itemsize
    if shards[-1] and size + nbytes > (2 << 30):
        shards.append([])
        size = 0
    shards[-1].append(n)
    size += nbytes
st = {{torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}}[dtype]
index = {{}}
for i, shard in enumerate(shards):
    fname = f"model-{{i + 1:05d}}-of-{{len(shards):05d}}.safetensors"
    header, at = {{"__metadata__": {{"format": "pt"}}}}, 0
    for n in shard:
        nbytes = saved[n].numel() * dtype.itemsize
        header[n] = {{"dtype": st, "shape": list(saved[n].shape), "data_offsets": [at, at + nbytes]}}
        at += nbytes
        index[n] = fname
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(os.path.join(folder, fname), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for k, n in enumerate(shard):
            g = torch.Generator().manual_seed(1000 + names.index(n))
            shape = tuple(saved[n].shape)
            if len(shape) == 1:  # norms ones, biases zero
                t = torch.ones(shape) if "norm" in n else torch.zeros(shape)
            elif "embed_tokens" in n:
                t = torch.randn(shape, generator=g)
            else:  # torch's Linear default: uniform within 1/sqrt(fan_in)
                t = (torch.rand(shape, generator=g) * 2 - 1) / shape[-1] ** 0.5
            f.write(t.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())
total = sum(saved[n].numel() * dtype.itemsize for n in names)
json.dump({{"metadata": {{"total_size": total}}, "weight_map": index}},
          open(os.path.join(folder, "model.safetensors.index.json"), "w"))
config.save_pretrained(folder)
save_byte_tokenizer(folder)
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=ROOT))
    json.dump(want, open(stamp, "w"))
    return folder


def run_ours(args, side, model_dir, swap, cap, factory, zipf):
    metrics = os.path.join(args.work, "m.json")
    if os.path.exists(metrics):
        os.unlink(metrics)
    argv = [
        "generate", "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", str(args.new_tokens),
        "--host-budget", str(args.budget_bytes), "--nvme-path", swap, "--device", "cpu", "--metrics-out", metrics,
        *OURS[side],
    ]  # fmt: skip
    code = f"MODEL_DIR = {model_dir!r}\nZIPF_S = {zipf!r}\n" + ZIPF_ROUTER + OURS_CHILD
    t0 = time.perf_counter()
    tree = args.before_tree if side == "aidaptiv_before" else ROOT
    rc, out, err, peak, ooms = run_capped([sys.executable, "-c", code, *argv], cap, factory, side, tree)
    wall = time.perf_counter() - t0
    if rc != 0:
        return {"rc": rc, "error": err[-1500:], "peak_bytes": peak, "oom_kills": ooms}
    m = json.load(open(metrics))
    r, st = m["results"][0], m["stats"]
    ex = st.get("experts") or {}
    lookups, hits = r["decode_expert_lookups"], r["decode_expert_hits"]
    steps = max(1, r["new_tokens"] - 1)
    # One expert's weights (every layer's experts are alike in these models).
    expert_nbytes = ex["active_bytes_per_token"] / (ex["layers"] * ex["top_k"]) if ex.get("layers") else None
    return {
        "rc": 0,
        "token_ids": r["token_ids"],
        "ttft_s": r["time_to_first_token_s"],
        "decode_s": r["decode_s"],
        "new_tokens": r["new_tokens"],
        "tokens_per_s": r["tokens_per_s"],
        "decode_bytes_per_token": r["decode_bytes_per_token"],
        "decode_expert_hit_rate": r["decode_expert_hit_rate"],
        "decode_expert_lookups": lookups,
        "decode_expert_hits": hits,
        # The bound: the experts the decoding steps needed that the cache did not hold, plus the layers streamed.
        "bound_bytes_per_token": (
            ((lookups - hits) * expert_nbytes / steps if expert_nbytes else 0) + st["streamed_bytes_per_pass"]
        ),
        "active_bytes_per_token": ex.get("active_bytes_per_token", 0) + st["streamed_bytes_per_pass"],
        "streamed_bytes_per_pass": st["streamed_bytes_per_pass"],
        "resident_bytes": st["resident_bytes"],
        "experts": ex,
        "layout_s": st["layout_s"],
        "read_wait_s": st["wait_s"],
        "peak_bytes": peak,
        "wall_s": wall,
    }


def run_accelerate(args, model_dir, offload, cap, factory, mode, zipf):
    code = (
        f"ROOT = {ROOT!r}\nPROMPT = {PROMPT!r}\nMODEL_DIR = {model_dir!r}\n"
        + ZIPF_ROUTER
        + (f"install_zipf_router({zipf!r}, 1234)\n" if zipf > 0 else "")
        + TIMED_GENERATE
        + ACCELERATE_CHILD
    )
    argv = [model_dir, args.budget_bytes, offload, args.new_tokens, args.dtype, mode, "cpu", 0]
    t0 = time.perf_counter()
    rc, out, err, peak, ooms = run_capped(
        [sys.executable, "-c", code, *map(str, argv)], cap if mode == "offload" else None, factory, mode
    )
    wall = time.perf_counter() - t0
    if rc != 0:
        return {"rc": rc, "error": err[-1500:], "peak_bytes": peak, "oom_kills": ooms}
    r = json.loads(out.strip().splitlines()[-1])
    r.update(rc=0, peak_bytes=peak, wall_s=wall)
    r["tokens_per_s"] = (r["new_tokens"] - 1) / r["decode_s"] if r["decode_s"] > 0 else 0.0
    return r


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES) + moe_presets())
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--budget", default="2GiB", help="host memory for weights, every side")
    ap.add_argument("--cap-gib", type=float, default=4.0, help="memory cgroup cap of every capped run")
    ap.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=f"comma-separated of {', '.join(SIDES)}")
    ap.add_argument("--routers", default="uniform,zipf", help="uniform (the random weights' own) and/or zipf")
    ap.add_argument("--zipf-s", type=float, default=1.0, help="the skewed routers' Zipf exponent")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-in-memory", action="store_true", help="skip the in-memory reference (RAM for the model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="OpenMP threads of every side")
    ap.add_argument(
        "--before",
        default=None,
        help="a git revision: adds the side aidaptiv_before, the routed side from that commit's tree (a worktree "
        "with this tree's engine module; the engine's sources must be the same), to measure a change",
    )
    ap.add_argument("--note", default="", help="a sentence the summary opens with (a validation run, say)")
    ap.add_argument("--summary-only", action="store_true", help="write OUT/summary.md from OUT/rows.jsonl")
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench_work", "generate_moe"), help="model and swap folder")
    ap.add_argument("--out", default=None, help="default bench/results/generate_moe/SHAPE_DTYPE")
    args = ap.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", "generate_moe", f"{args.shape}_{args.dtype}")
    args.budget_bytes = parse_size(args.budget, "--budget")
    global THREADS
    THREADS = args.threads
    args.sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    args.routers = [x.strip() for x in args.routers.split(",") if x.strip()]
    if set(args.sides) - set(SIDES) or "aidaptiv" not in args.sides:
        ap.error(f"--sides: aidaptiv and any of {', '.join(s for s in SIDES if s != 'aidaptiv')}")
    if args.before and "aidaptiv_before" not in args.sides:
        args.sides.insert(1, "aidaptiv_before")
    if "aidaptiv_before" in args.sides and not args.before:
        ap.error("--sides aidaptiv_before needs --before REV")
    if set(args.routers) - {"uniform", "zipf"} or not args.routers:
        ap.error("--routers: uniform and/or zipf")
    rows_path = os.path.join(args.out, "rows.jsonl")
    if args.summary_only:
        write_summary(args.out, [json.loads(line) for line in open(rows_path)])
        return
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    model_dir = write_model(args.shape, args.dtype, os.path.join(args.work, f"{args.shape}-{args.dtype}"))
    weight_bytes = sum(
        os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors")
    )
    swap, offload = os.path.join(args.work, "swap"), os.path.join(args.work, "offload")
    os.makedirs(swap, exist_ok=True)
    cap = int(args.cap_gib * (1 << 30))
    factory, where = probe_cgroup()
    if factory is None:
        sys.exit(f"no usable memory cgroup ({where}): this bench needs one to give every side the same memory")
    common = {
        "shape": args.shape, "config": shape_config(args.shape), "dtype": args.dtype, "weight_bytes": weight_bytes,
        "budget_bytes": args.budget_bytes, "cap_bytes": cap, "new_tokens": args.new_tokens, "zipf_s": args.zipf_s,
        "note": args.note, "threads": args.threads,
        "machine": summary(machine_info(swap)), "git_sha": git_sha(),
        "before": subprocess.run(["git", "-C", ROOT, "rev-parse", args.before], capture_output=True, text=True,
                                 check=True).stdout.strip() if args.before else None,
        "command": " ".join(["python bench/generate_moe.py", *sys.argv[1:]]),
    }  # fmt: skip
    rows = []
    open(rows_path, "w").close()

    def record(row):
        row.update(common)
        rows.append(row)
        with open(rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        brief = {k: row.get(k) for k in ("side", "router", "repeat", "rc", "tokens_per_s", "ttft_s")}
        brief["read_per_token"] = row.get("decode_bytes_per_token") or row.get("disk_read_bytes_per_token")
        print(json.dumps(brief), flush=True)

    record(
        {
            "side": "disk", "router": None, "repeat": 0, "rc": 0, "file_mb": 2048,
            "read_gbps": disk_read_gbps(swap, 2048),
        }
    )  # fmt: skip
    parent = tempfile.mkdtemp(prefix="generate-moe-before-") if args.before else None
    args.before_tree = baseline_tree(args.before, parent) if args.before else None
    try:
        run_routers(args, model_dir, swap, offload, cap, factory, record)
    finally:
        if args.before_tree:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", args.before_tree], check=False)
            shutil.rmtree(parent, ignore_errors=True)
    write_summary(args.out, rows)


def run_routers(args, model_dir, swap, offload, cap, factory, record):
    """Every router's runs: the in-memory reference, then the sides interleaved, ``args.repeats`` times."""
    for router in args.routers:
        zipf = args.zipf_s if router == "zipf" else 0.0
        if not args.no_in_memory:
            drop_page_cache(model_dir)
            ref = run_accelerate(args, model_dir, offload, None, factory, "memory", zipf)
            record(dict(ref, side="in_memory", router=router, repeat=0))
        else:
            ref = {}
        for rep in range(args.repeats):
            for side in args.sides if rep % 2 == 0 else args.sides[::-1]:
                drop_page_cache(model_dir, offload)
                if side == "accelerate":
                    r = run_accelerate(args, model_dir, offload, cap, factory, "offload", zipf)
                else:
                    r = run_ours(args, side, model_dir, swap, cap, factory, zipf)
                r["same_tokens_as_in_memory"] = r.get("token_ids") == ref.get("token_ids") if ref else None
                record(dict(r, side=side, router=router, repeat=rep))


def label(side: str, first: dict) -> str:
    """A side's name in the summary (the --before side with its commit)."""
    if side == "aidaptiv_before":
        return f"aidaptiv-ds generate at {(first.get('before') or '?')[:10]} (routed experts, the commit before)"
    return SIDES[side]


def write_summary(out, rows):
    """OUT/summary.md from the rows alone."""
    first = rows[0]
    disk = next(r for r in rows if r["side"] == "disk")
    gbps = disk["read_gbps"]
    lines = [
        f"# Mixture-of-experts generation beyond host memory: routed experts vs dense streaming vs accelerate "
        f"({time.strftime('%Y-%m-%d')})",
        "",
        *([f"**{first['note']}**", ""] if first.get("note") else []),
        f"Model: `{first['shape']}` shape ({first['config'].get('model_type', 'olmoe')}, transformers' config: "
        f"{json.dumps({k: v for k, v in first['config'].items() if k not in CONFIG_NOISE})}), "
        f"random weights, {first['dtype']}, {format_size(first['weight_bytes'])} of weights written as transformers "
        f"saves them (one tensor per expert), in shards of 2 GiB cut in name order as the hub's are; host budget for weights {format_size(first['budget_bytes'])} on "
        f"every side ({first['weight_bytes'] / first['budget_bytes']:.1f}x smaller than the weights; accelerate: "
        f"max_memory), every capped run in a memory cgroup of {format_size(first['cap_bytes'])} (page cache "
        f"charged); page cache of the weight files dropped before each run; greedy, {first['new_tokens']} new "
        f"tokens, sides interleaved (order reversed every other repeat), {first.get('threads')} OpenMP threads a "
        f"side. Disk: {gbps:.2f} GB/s O_DIRECT read "
        f"(io-bench, uring, 2 GiB file). Machine: {first['machine']}; git {first.get('git_sha')}.",
        "",
        "Routers: *uniform* is the random weights' own routing, about uniform over the experts: the worst case "
        "for any expert cache. *zipf* draws each token's experts from a Zipf distribution "
        f"(s = {first['zipf_s']}) over a fixed random order of each layer's experts, as skewed as trained routers "
        "are assumed to be (bench/generate_moe.py's docstring).",
    ]
    for router in [r for r in ("uniform", "zipf") if any(x.get("router") == r for x in rows)]:
        rs = [r for r in rows if r.get("router") == router]
        ref = next((r for r in rs if r["side"] == "in_memory" and r["rc"] == 0), None)
        sides = [s for s in SIDES if any(r["side"] == s for r in rs)]
        ok = {s: [r for r in rs if r["side"] == s and r["rc"] == 0] for s in sides}
        lines += [
            "",
            f"**Routers: {router}**",
            "",
            "| side | tokens/s (median, min-max) | time to first token s | load s | read per token | "
            "expert cache hit rate | peak cgroup memory | tokens = in-memory |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in sides:
            got = ok[s]
            if not got:
                fails = [r for r in rs if r["side"] == s]
                why = (fails[0].get("error") or "").strip().splitlines()[-1:] if fails else ["?"]
                kills = sum(r.get("oom_kills") or 0 for r in fails)
                said = f"{kills} killed by the cap" if kills else (why or [""])[0][-200:].replace("|", "/")
                lines.append(f"| {label(s, first)} | failed in {len(fails)} runs: {said} | | | | | | |")
                continue
            tps = [r["tokens_per_s"] for r in got]
            load = median([r.get("load_s", r.get("layout_s")) for r in got])
            read = median([r.get("decode_bytes_per_token", r.get("disk_read_bytes_per_token")) for r in got])
            hit = median([r.get("decode_expert_hit_rate") for r in got])
            same = [r.get("same_tokens_as_in_memory") for r in got]
            lines.append(
                f"| {label(s, first)} | {median(tps):.3f} ({min(tps):.3f}-{max(tps):.3f}) | "
                f"{median([r['ttft_s'] for r in got]):.2f} | {'' if load is None else f'{load:.1f}'} | "
                f"{'' if read is None else format_size(read)} | {'' if hit is None else f'{100 * hit:.0f}%'} | "
                f"{format_size(max(r['peak_bytes'] or 0 for r in got))} | "
                f"{'not measured' if None in same else all(same)} |"
            )
        if ref:
            lines.append(
                f"| in-memory model (no cap) | {ref['tokens_per_s']:.3f} | {ref['ttft_s']:.2f} | | | | | reference |"
            )
        lines.append("")
        for other in sides[1:]:
            if other.startswith("aidaptiv_swap"):
                continue
            pairs = [
                a["tokens_per_s"] / b["tokens_per_s"]
                for a in ok["aidaptiv"]
                for b in ok[other]
                if a["repeat"] == b["repeat"] and b["tokens_per_s"]
            ]
            target = {"aidaptiv_whole": 4, "accelerate": 10}.get(other)
            if pairs:
                lines.append(
                    f"**routed / {label(other, first)} tokens/s: {statistics.median(pairs):.2f}x** (repeat pairs "
                    f"{min(pairs):.2f}-{max(pairs):.2f}x" + (f"; target >= {target}x)." if target else ").")
                )
        ours = ok["aidaptiv"]
        if ours:
            read = median([r["decode_bytes_per_token"] for r in ours])
            bound = median([r["bound_bytes_per_token"] for r in ours])
            active = median([r["active_bytes_per_token"] for r in ours])
            hit = median([r["decode_expert_hit_rate"] for r in ours])
            step = 1 / median([r["tokens_per_s"] for r in ours])
            compute = ref["decode_s"] / max(1, ref["new_tokens"] - 1) if ref else None
            ex = ours[0]["experts"]
            lines.append(
                f"Read per decoded token: {format_size(read)}; the bound (the experts decoding needed that the cache "
                f"did not hold, {100 * (1 - hit):.0f}% of {ex['layers']} layers x {ex['top_k']} experts, plus "
                f"{format_size(ours[0]['streamed_bytes_per_pass'])} of layers streamed a step) "
                f"{format_size(bound)}: **{read / bound:.3f}x the bound** (target <= 1.3x); every expert a token uses "
                f"with no cache {format_size(active)}. Expert cache: {ex['cache_slots']} of {ex['experts']} experts "
                f"({format_size(ex['cache_slots'] * ex['slot_bytes'])}), hit rate {100 * hit:.0f}% while decoding"
                + (" (uniform routing: the worst case for a cache)" if router == "uniform" else "")
                + f". Time a token {step:.3f} s against the I/O bound {read / (gbps * 1e9):.3f} s ({format_size(read)} "
                f"/ {gbps:.2f} GB/s)"
                + (f" and the in-memory model's compute {compute:.3f} s" if compute else "")
                + f"; the experts were read from {READ_FROM.get(ex['read_from'], ex['read_from'])}."
            )
    commands = []
    for r in rows:
        if r.get("command") and r["command"] not in commands:
            commands.append(r["command"])
    lines += ["", "Commands: " + "; ".join(f"`{c}`" for c in commands), ""]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
