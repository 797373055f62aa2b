#!/usr/bin/env python3
"""Generation with weights larger than the host memory given: `aidaptiv-ds generate` against Hugging Face's
disk offload (accelerate: ``from_pretrained(device_map="auto", max_memory=..., offload_folder=...)``), the
anchor users would pick instead, on one machine, in one run (the inference issue's targets).

Conditions: a preset shape with random weights saved as a Hugging Face folder (default tinyllama-1.1b, fp32:
4.4 GB of weights) and a host budget well below it (default 1 GiB: the weights are 4x the budget). Both sides
get the same budget for weights (ours: --host-budget; accelerate: max_memory={"cpu": budget}) and run in a
memory cgroup of the same cap (--cap-gib: the budget plus what the framework needs), which charges the page
cache too, so neither side keeps the weights in RAM through the cache. Before every run the weight files' and
the offload folder's pages are dropped from the page cache (posix_fadvise DONTNEED), so every side reads from
the disk. Sides are interleaved, their order alternating over the repeats; greedy decoding of the same prompt.

Measured in the same run: the in-memory model (no cap) for the reference tokens and its decode time per token
(the compute bound), and the disk's O_DIRECT read bandwidth (aidaptiv-ds io-bench, uring, 1 MiB blocks, queue
depth 32) for the I/O bound (bytes our side streams per token / bandwidth). Then the prompt cache: a prompt of
--kv-prefix tokens (a long document) generated twice by `aidaptiv-ds generate --kv-cache`: the first run
computes the prefix and stores its keys and values, the second reads them back; time to first token of each,
and the next tokens compared.

    python bench/generate_offload.py [--repeats 3] [--new-tokens 16] [--out bench/results/generate_offload/tinyllama-1.1b_fp32]

Writes one JSON row per run to OUT/rows.jsonl and the medians to OUT/summary.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from aidaptiv_ds.common.sizes import format_size, parse_size  # noqa: E402
from aidaptiv_ds.harness.hostcap import probe_cgroup  # noqa: E402
from aidaptiv_ds.harness.machine import machine_info, summary  # noqa: E402

# The sides and their names in the summary: ours, then the baselines.
SIDES = {
    "aidaptiv": "aidaptiv-ds generate",
    "aidaptiv_encode_off": "aidaptiv-ds generate --encode-weights off",
    "aidaptiv_encode_on": "aidaptiv-ds generate --encode-weights on",
    "accelerate": "accelerate disk offload",
    "zero_inference": "DeepSpeed ZeRO-Inference (NVMe)",
}
# What ours with other flags changes.
VARIANT_MEANS = {
    "aidaptiv_encode_off": "ours reading its streamed layers as they are",
    "aidaptiv_encode_on": "ours encoding its streamed layers whatever their dtype",
}
DEFAULT_SIDES = ("aidaptiv", "accelerate", "zero_inference")
KV_CAP_GIB = 4.0  # the prompt-cache runs' cap (rows measured before they kept it ran with this default)
# What the host budget for weights is, on each baseline.
BUDGET_MEANS = {
    "accelerate": "accelerate: max_memory",
    "zero_inference": "ZeRO-Inference: its pinned parameter buffers, as many as fit, each the largest parameter",
}
PROMPT = "The history of the printing press begins in the fifteenth century, when"


def make_model(shape: str, dtype: str, folder: str, context: int) -> str:
    """A random-weight Hugging Face folder of ``shape`` (kept between runs: a stamp names what it holds)."""
    stamp = os.path.join(folder, "bench-stamp.json")
    want = {"shape": shape, "dtype": dtype, "context": context}
    if os.path.exists(stamp) and json.load(open(stamp)) == want:
        return folder
    code = f"""
import torch, sys
sys.path.insert(0, {ROOT!r})
from aidaptiv_ds.models import presets
from aidaptiv_ds.models.tokenizer import save_byte_tokenizer
spec = presets.resolve({shape!r})
spec.config.max_position_embeddings = {context}
torch.manual_seed(0)
model = presets.build_model(spec, getattr(torch, {dtype!r}))
model.save_pretrained({folder!r}, max_shard_size="2GB")
save_byte_tokenizer({folder!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    json.dump(want, open(stamp, "w"))
    return folder


def drop_page_cache(*paths: str) -> None:
    """Drop the clean pages of every file under ``paths`` from the page cache."""
    for path in paths:
        if not os.path.exists(path):
            continue
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# Prepended to each baseline's child: greedy generation of PROMPT, timed per token by a logits processor, with
# what the block layer read for the process (all its threads) between the first and the last token.
TIMED_GENERATE = r"""
def read_bytes():
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


def timed_generate(model, model_dir, new, device, grad_mode):
    import time, torch
    from transformers import LogitsProcessorList
    from aidaptiv_ds.models.tokenizer import HFTokenizer
    tok = HFTokenizer(model_dir)
    ids = torch.tensor([tok.encode(PROMPT, add_bos=True, add_eos=False)], device=device)
    times, disk = [], []
    def clock(input_ids, scores):
        times.append(time.perf_counter())
        disk.append(read_bytes())
        return scores
    start = time.perf_counter()
    with grad_mode():
        out = model.generate(ids, max_new_tokens=int(new), do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, logits_processor=LogitsProcessorList([clock]))
    new_ids = out[0, ids.shape[1]:].tolist()
    read = (disk[-1] - disk[0]) / (len(disk) - 1) if len(disk) > 1 and None not in disk else None
    return {"token_ids": new_ids, "ttft_s": times[0] - start, "decode_s": times[-1] - times[0],
            "new_tokens": len(new_ids), "disk_read_bytes_per_token": read}
"""

ACCELERATE_CHILD = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
sys.path.insert(0, ROOT)
model_dir, budget, offload, new, dtype, mode, device, gpu_cap = sys.argv[1:9]
t0 = time.perf_counter()
kw = dict(dtype=getattr(torch, dtype))
memory = {"cpu": int(budget)}
if device == "cuda" and mode == "offload":  # the GPU first, up to its cap; then the host budget; then the disk
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, float(gpu_cap) / total))
    memory = {0: int(gpu_cap), "cpu": int(budget)}
if mode == "offload":
    kw.update(device_map="auto", max_memory=memory, offload_folder=offload, offload_state_dict=True)
model = AutoModelForCausalLM.from_pretrained(model_dir, **kw).eval()
if device == "cuda" and mode == "memory":
    model = model.cuda()
load_s = time.perf_counter() - t0
out = timed_generate(model, model_dir, new, "cuda" if device == "cuda" else "cpu", torch.inference_mode)
devices = sorted(set(str(v) for v in getattr(model, "hf_device_map", {}).values()))
print(json.dumps(dict(out, load_s=load_s, devices=devices)))
"""


ZERO_INFERENCE_CHILD = r"""
import json, os, sys, time, torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
import deepspeed
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig
sys.path.insert(0, ROOT)
from aidaptiv_ds.models.presets import largest_parameter_numel
model_dir, budget, swap, new, dtype, gpu_cap = sys.argv[1:7]
if torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, float(gpu_cap) / total))
t0 = time.perf_counter()
config = AutoConfig.from_pretrained(model_dir)
h = config.hidden_size
elem = torch.finfo(getattr(torch, dtype)).bits // 8
largest = largest_parameter_numel(config)
# DeepSpeed's ZeRO-Inference example (DeepSpeedExamples inference/huggingface/zero_inference/run_model.py):
# prefetch and live parameters 2*h*h, persistence threshold h, five parameter buffers, aio queue depth 8.
# Here the buffers are sized to the budget: as many as fit, each the largest parameter (DeepSpeed asserts
# when a parameter is larger than its buffer); pinned, as ours are.
count = int(budget) // (largest * elem)
cfg = {
    "train_micro_batch_size_per_gpu": 1,
    "bf16": {"enabled": dtype == "bfloat16"},
    "zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_size": 2 * h * h,
        "stage3_param_persistence_threshold": h,
        "stage3_max_live_parameters": 2 * h * h,
        "offload_param": {"device": "nvme", "nvme_path": swap, "pin_memory": True, "buffer_count": count,
                          "buffer_size": largest},
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
}
keep = HfDeepSpeedConfig(cfg)  # from_pretrained builds the model under zero.Init while this lives
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
model = deepspeed.initialize(model=model, config=cfg)[0].module.eval()
load_s = time.perf_counter() - t0
# ZeRO-3's hooks gather parameters in place, which inference_mode forbids: no_grad, as DeepSpeed's example.
out = timed_generate(model, model_dir, new, "cuda" if torch.cuda.is_available() else "cpu", torch.no_grad)
print(json.dumps(dict(out, load_s=load_s, buffer_count=count, buffer_bytes=count * largest * elem)))
"""


def run_capped(cmd, cap_bytes, factory, name):
    """Run ``cmd`` in a fresh memory cgroup of ``cap_bytes``; (returncode, stdout, stderr, peak bytes, oom kills)."""
    cg = factory.create(f"aidaptiv-gen-bench-{os.getpid()}-{name}", cap_bytes) if factory and cap_bytes else None
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(os.cpu_count()))
    try:
        p = subprocess.run(cg.wrap(cmd) if cg else cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        peak = cg.peak_bytes() if cg else None
        ooms = cg.oom_kills() if cg else 0
    finally:
        if cg:
            cg.remove()
    return p.returncode, p.stdout, p.stderr, peak, ooms


def run_ours(args, model_dir, swap, cap, factory, extra=(), metrics_name="m.json", prompt=PROMPT, new=None):
    metrics = os.path.join(args.work, metrics_name)
    if os.path.exists(metrics):
        os.unlink(metrics)
    cmd = [
        sys.executable,
        "-m",
        "aidaptiv_ds",
        "generate",
        "--model",
        model_dir,
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(new or args.new_tokens),
        "--host-budget",
        str(args.budget_bytes),
        "--nvme-path",
        swap,
        "--device",
        args.device,
        *(["--gpu-mem-cap-gb", f"{args.gpu_cap_bytes / 2**30:g}"] if args.device == "cuda" else []),
        "--metrics-out",
        metrics,
        "--quiet",
        *extra,
    ]
    t0 = time.perf_counter()
    rc, out, err, peak, ooms = run_capped(cmd, cap, factory, "ours")
    wall = time.perf_counter() - t0
    if rc != 0:
        return {"rc": rc, "error": err[-1500:], "peak_bytes": peak, "oom_kills": ooms}
    m = json.load(open(metrics))
    r = m["results"][0]
    return {
        "rc": 0,
        "token_ids": r["token_ids"],
        "ttft_s": r["time_to_first_token_s"],
        "decode_s": r["decode_s"],
        "new_tokens": r["new_tokens"],
        "tokens_per_s": r["tokens_per_s"],
        "reused_prefix_tokens": r["reused_prefix_tokens"],
        "streamed_bytes_per_token": m["stats"]["streamed_bytes_per_pass"],
        "streamed_weight_bytes_per_token": m["stats"].get(
            "streamed_weight_bytes_per_pass", m["stats"]["streamed_bytes_per_pass"]
        ),
        "decode_wait_s": m["stats"].get("decode_s", 0.0),
        "bytes_read": m["stats"]["bytes_read"],
        "read_wait_s": m["stats"]["wait_s"],
        "layout_s": m["stats"]["layout_s"],
        "resident_bytes": m["stats"]["resident_bytes"],
        "kv_cache": m["stats"].get("kv_cache"),
        "peak_bytes": peak,
        "wall_s": wall,
    }


def run_baseline(child, argv, cap, factory, name):
    """One baseline's child (``child`` after the shared timing code) in a cgroup of ``cap``: its JSON row."""
    code = f"ROOT = {ROOT!r}\nPROMPT = {PROMPT!r}\n" + TIMED_GENERATE + child
    t0 = time.perf_counter()
    rc, out, err, peak, ooms = run_capped([sys.executable, "-c", code, *map(str, argv)], cap, factory, name)
    wall = time.perf_counter() - t0
    if rc != 0:
        return {"rc": rc, "error": err[-1500:], "peak_bytes": peak, "oom_kills": ooms}
    r = json.loads(out.strip().splitlines()[-1])
    r.update(rc=0, peak_bytes=peak, wall_s=wall)
    r["tokens_per_s"] = (r["new_tokens"] - 1) / r["decode_s"] if r["decode_s"] > 0 else 0.0
    return r


def run_hf(args, model_dir, offload, cap, factory, mode):
    """Hugging Face's model: in memory (mode "memory", uncapped) or with accelerate's disk offload."""
    argv = [model_dir, args.budget_bytes, offload, args.new_tokens, args.dtype, mode, args.device, args.gpu_cap_bytes]
    return run_baseline(ACCELERATE_CHILD, argv, cap if mode == "offload" else None, factory, mode)


def run_zero_inference(args, model_dir, swap, cap, factory):
    """DeepSpeed's ZeRO-Inference: the model under ZeRO-3 with its parameters offloaded to NVMe, HF generate."""
    subprocess.run(["rm", "-rf", swap], check=True)
    os.makedirs(swap)
    try:
        argv = [model_dir, args.budget_bytes, swap, args.new_tokens, args.dtype, args.gpu_cap_bytes]
        return run_baseline(ZERO_INFERENCE_CHILD, argv, cap, factory, "zero_inference")
    finally:
        subprocess.run(["rm", "-rf", swap], check=True)


def disk_read_gbps(swap: str, size_mb: int) -> float:
    """The disk's O_DIRECT read rate on a file of ``size_mb`` that io-bench writes and reads back."""
    p = subprocess.run(
        [sys.executable, "-m", "aidaptiv_ds", "io-bench", "--nvme-path", swap, "--engines", "uring", "--size-mb",
         str(size_mb), "--repeat", "1", "--json"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), check=True, cwd=ROOT,
    )  # fmt: skip
    return json.loads(p.stdout)["engines"]["uring"]["read_gbps"]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tinyllama-1.1b", help="a preset of aidaptiv_ds.models.presets")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--budget", default="1GiB", help="host memory for weights, both sides")
    ap.add_argument("--cap-gib", type=float, default=3.0, help="memory cgroup cap of every capped run, both sides")
    ap.add_argument(
        "--sides",
        default=",".join(DEFAULT_SIDES),
        help=f"comma-separated, aidaptiv first (default {','.join(DEFAULT_SIDES)}; also aidaptiv_encode_off and "
        "aidaptiv_encode_on: ours with --encode-weights off or on); run in this order, reversed every other repeat",
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every side computes")
    ap.add_argument(
        "--gpu-cap-gib",
        type=float,
        default=1.5,
        help="with cuda: GPU memory of every capped side (torch.cuda.set_per_process_memory_fraction; accelerate's "
        "max_memory for the GPU); ours gives three quarters of it to weights",
    )
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-prefix", type=int, default=8192, help="prompt tokens of the prompt-cache runs (0: skip)")
    ap.add_argument("--kv-repeats", type=int, default=2)
    ap.add_argument(
        "--kv-cap-gib",
        type=float,
        default=KV_CAP_GIB,
        help="cgroup cap of the prompt-cache runs (a long prefill's activations)",
    )
    ap.add_argument("--summary-only", action="store_true", help="write OUT/summary.md from OUT/rows.jsonl")
    ap.add_argument("--kv-only", action="store_true", help="measure the prompt cache again, keeping OUT's other rows")
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench_work", "generate"), help="model and swap folder")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "generate_offload", "tinyllama-1.1b_fp32"))
    args = ap.parse_args()
    args.budget_bytes = parse_size(args.budget, "--budget")
    args.gpu_cap_bytes = int(args.gpu_cap_gib * 2**30) if args.device == "cuda" else 0
    args.sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    unknown = sorted(set(args.sides) - set(SIDES))
    if unknown or "aidaptiv" not in args.sides:
        ap.error(f"--sides: aidaptiv and any of {', '.join(s for s in SIDES if s != 'aidaptiv')} (got {args.sides})")
    rows_path = os.path.join(args.out, "rows.jsonl")
    if args.summary_only:  # from the rows alone: what they ran is in them
        write_summary(args.out, [json.loads(line) for line in open(rows_path)])
        return
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    context = max(2048, args.kv_prefix + 256)
    model_dir = make_model(args.shape, args.dtype, os.path.join(args.work, f"{args.shape}-{args.dtype}"), context)
    weight_bytes = sum(
        os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors")
    )
    swap, offload = os.path.join(args.work, "swap"), os.path.join(args.work, "offload")
    os.makedirs(swap, exist_ok=True)
    cap = int(args.cap_gib * (1 << 30))
    factory, where = probe_cgroup()
    if factory is None and args.device == "cpu":
        sys.exit(f"no usable memory cgroup ({where}): this bench needs one to give both sides the same memory")
    if factory is None:  # a GPU machine without one: the GPU cap still holds; said in the summary
        print(f"no usable memory cgroup ({where}): host memory not capped", file=sys.stderr)
        cap = 0
    common = {
        "shape": args.shape, "dtype": args.dtype, "weight_bytes": weight_bytes, "budget_bytes": args.budget_bytes,
        "cap_bytes": cap, "new_tokens": args.new_tokens, "machine": summary(machine_info(swap)),
        "device": args.device, "gpu_cap_bytes": args.gpu_cap_bytes,
        "command": " ".join(["python bench/generate_offload.py", *sys.argv[1:]]),
    }  # fmt: skip
    rows = []

    def record(row):
        row.update(common)
        rows.append(row)
        with open(rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        brief = {k: row.get(k) for k in ("side", "repeat", "rc", "tokens_per_s", "ttft_s", "peak_bytes")}
        print(json.dumps(brief), flush=True)

    if args.kv_only:  # keep the throughput rows, measure the prompt cache again
        kept = [json.loads(line) for line in open(rows_path)] if os.path.exists(rows_path) else []
        kept = [r for r in kept if r["side"] != "kv_prefix"]
        with open(rows_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        rows.extend(kept)
        args.repeats = 0
    else:
        open(rows_path, "w").close()
        drop_page_cache(model_dir)
        record(dict(run_hf(args, model_dir, offload, None, factory, "memory"), side="in_memory", repeat=0))
        # The bound's read rate on a file the size of the weights, as large as what a token streams (a
        # smaller file reads faster here: the 1 GiB figure is kept beside it).
        record(
            {
                "side": "disk", "repeat": 0, "rc": 0, "file_mb": weight_bytes >> 20,
                "read_gbps": disk_read_gbps(swap, weight_bytes >> 20), "read_gbps_1gib": disk_read_gbps(swap, 1024),
            }
        )  # fmt: skip
    ref = next(r for r in rows if r["side"] == "in_memory")
    runners = {
        "aidaptiv": lambda: run_ours(args, model_dir, swap, cap, factory),
        "aidaptiv_encode_off": lambda: run_ours(args, model_dir, swap, cap, factory, extra=("--encode-weights", "off")),
        "aidaptiv_encode_on": lambda: run_ours(args, model_dir, swap, cap, factory, extra=("--encode-weights", "on")),
        "accelerate": lambda: run_hf(args, model_dir, offload, cap, factory, "offload"),
        "zero_inference": lambda: run_zero_inference(args, model_dir, os.path.join(args.work, "zi_swap"), cap, factory),
    }
    for rep in range(args.repeats):
        for side in args.sides if rep % 2 == 0 else args.sides[::-1]:
            drop_page_cache(model_dir, offload)
            r = runners[side]()
            r["same_tokens_as_in_memory"] = r.get("token_ids") == ref.get("token_ids")
            record(dict(r, side=side, repeat=rep))
    if args.kv_prefix:
        document = ("In the year of the long rains the river rose above its banks and the valley farmers moved "
                    "their herds to the hills. ")  # fmt: skip
        text = (document * (args.kv_prefix // len(document) + 1))[: args.kv_prefix - 1 - 24] + " What happened next?"
        kv_dir = os.path.join(args.work, "kv")
        for rep in range(args.kv_repeats):
            subprocess.run(["rm", "-rf", kv_dir], check=True)
            for phase in ("compute", "read_back"):
                drop_page_cache(model_dir, kv_dir)
                extra = ("--kv-cache", kv_dir, "--kv-host-budget", "0", "--kv-cache-size", "64GiB")
                kv_cap = int(args.kv_cap_gib * (1 << 30))
                r = run_ours(args, model_dir, swap, kv_cap, factory, extra=extra, prompt=text, new=4)
                r["phase"] = phase
                record(dict(r, side="kv_prefix", repeat=rep, prompt_tokens=args.kv_prefix, kv_cap_bytes=kv_cap))
    write_summary(args.out, rows)


def write_summary(out, rows):
    """OUT/summary.md from the rows alone (each carries the shape, dtype, budget and caps it ran with)."""
    first = rows[0]
    shape, dtype, weight_bytes = first["shape"], first["dtype"], first["weight_bytes"]
    budget_bytes, new_tokens = first["budget_bytes"], first["new_tokens"]
    ref = next(r for r in rows if r["side"] == "in_memory")
    disk = next(r for r in rows if r["side"] == "disk")
    kv_rows = [r for r in rows if r["side"] == "kv_prefix"]
    gbps = disk["read_gbps"]
    file_words = f"a {disk['file_mb'] / 1024:.1f} GiB file" if "file_mb" in disk else "a 1 GiB file"
    repeats = len({r["repeat"] for r in rows if r["side"] == "aidaptiv"})
    sides = [side for side in SIDES if any(r["side"] == side for r in rows)]
    ok = {side: [r for r in rows if r["side"] == side and r["rc"] == 0] for side in sides}
    ours = ok["aidaptiv"]
    t_ours = median([r["tokens_per_s"] for r in ours])
    streamed = median([r["streamed_bytes_per_token"] for r in ours])
    compute_s = ref["decode_s"] / max(1, ref["new_tokens"] - 1) if ref.get("rc") == 0 else None
    io_s = streamed / (gbps * 1e9) if streamed else None
    bound_s = max(x for x in (compute_s, io_s) if x is not None) if (compute_s or io_s) else None
    step_s = 1 / t_ours if t_ours else None
    weights_streamed = median([r.get("streamed_weight_bytes_per_token", r["streamed_bytes_per_token"]) for r in ours])
    baselines = " and ".join(SIDES[side] for side in sides[1:] if not side.startswith("aidaptiv"))
    device, gpu_cap = rows[0].get("device", "cpu"), rows[0].get("gpu_cap_bytes")
    host_cap = rows[0].get("cap_bytes")
    lines = [
        f"# Generation beyond host memory: aidaptiv-ds generate vs {baselines} ({time.strftime('%Y-%m-%d')})",
        "",
        f"Model: `{shape}` shape, random weights, {dtype}, {format_size(weight_bytes)} of weights; host budget "
        f"for weights {format_size(budget_bytes)} on every side ({weight_bytes / budget_bytes:.1f}x smaller "
        f"than the weights; {'; '.join(BUDGET_MEANS[side] for side in sides[1:] if side in BUDGET_MEANS)}); "
        + "".join(f"{SIDES[side]}: {VARIANT_MEANS[side]}; " for side in sides if side in VARIANT_MEANS)
        + (
            f"every capped run in a memory cgroup of {format_size(host_cap)} (page cache charged); "
            if host_cap
            else "host memory NOT capped (no usable memory cgroup on this machine: accelerate's offload folder may "
            "stay in the page cache); "
        )
        + (
            f"computed on the GPU, each side's GPU memory capped at {format_size(gpu_cap)} "
            "(torch.cuda.set_per_process_memory_fraction; accelerate's max_memory for the GPU; ours gives three "
            "quarters of it to weights); "
            if device == "cuda"
            else ""
        )
        + f"page cache of the weight files dropped before each run; greedy, {new_tokens} new tokens, "
        f"{repeats} interleaved repeats (order reversed every other repeat). Machine: {rows[0]['machine']}.",
        "",
        "| side | tokens/s (median, min-max) | time to first token s | load s | read per token | peak cgroup memory | "
        "tokens = in-memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in sides:
        rs = ok[side]
        if not rs:
            fails = [r for r in rows if r["side"] == side]
            why = fails[0].get("error", "").strip().splitlines()[-1:] if fails else ["?"]
            ooms = sum(r.get("oom_kills") or 0 for r in fails)
            peak = max((r.get("peak_bytes") or 0 for r in fails), default=0)
            lines.append(
                f"| {SIDES[side]} | failed in {len(fails)} of {len(fails)} runs: "
                + (f"{ooms} killed by the cap (out of memory)" if ooms else (why or [""])[0][-200:].replace("|", "/"))
                + f" | | | | {format_size(peak) if peak else ''} | |"
            )
            continue
        tps = [r["tokens_per_s"] for r in rs]
        load = median([r.get("load_s", r.get("layout_s")) for r in rs])
        # Ours: the layers its plan streams each pass (what its engine reads a step); the others: what the block layer read
        # for the process between the first and the last token (/proc/self/io), page cache hits not counted.
        read = median([r.get("streamed_bytes_per_token", r.get("disk_read_bytes_per_token")) for r in rs])
        lines.append(
            f"| {SIDES[side]} | {median(tps):.3f} ({min(tps):.3f}-{max(tps):.3f}) | {median([r['ttft_s'] for r in rs]):.2f} | "
            f"{'' if load is None else f'{load:.1f}'} | {'' if read is None else format_size(read)} | "
            f"{format_size(max(r['peak_bytes'] or 0 for r in rs))} | "
            f"{all(r['same_tokens_as_in_memory'] for r in rs)} |"
        )
    if ref.get("rc") == 0:
        lines.append(
            f"| in-memory model (no cap) | {ref['tokens_per_s']:.3f} | {ref['ttft_s']:.2f} | | | | reference |"
        )
    lines.append("")
    # Ours (its defaults) against every other side; ours with other flags against the baselines too.
    variants = [side for side in sides if side.startswith("aidaptiv_")]
    matchups = [("aidaptiv", side) for side in sides[1:]]
    matchups += [(v, side) for v in variants for side in sides if not side.startswith("aidaptiv")]
    for mine, side in matchups:
        pairs = [
            a["tokens_per_s"] / b["tokens_per_s"]
            for a in ok[mine]
            for b in ok[side]
            if a["repeat"] == b["repeat"] and b["tokens_per_s"]
        ]
        if pairs:
            name = "aidaptiv" if mine == "aidaptiv" else SIDES[mine]
            lines.append(
                f"**{name} / {SIDES[side]} tokens/s: {statistics.median(pairs):.2f}x** (repeat pairs "
                f"{min(pairs):.2f}-{max(pairs):.2f}x)."
            )
    if bound_s and step_s:
        lines.append(
            f"Bound per token: max(compute {compute_s:.3f} s (the in-memory model's decode step), I/O {io_s:.3f} s "
            f"({format_size(streamed)} streamed per token / {gbps:.2f} GB/s O_DIRECT read of {file_words}, io-bench "
            f"in this run)) = "
            f"{bound_s:.3f} s; ours {step_s:.3f} s a token: **{step_s / bound_s:.2f}x the bound**. While decoding ours "
            f"read the swap file at {streamed / step_s / 1e9:.2f} GB/s (bytes streamed per token / time per token), "
            f"against io-bench's {gbps:.2f} GB/s on {file_words}"
            + (f" ({disk['read_gbps_1gib']:.2f} GB/s on a 1 GiB file)" if "read_gbps_1gib" in disk else "")
            + (
                f". Ours stores its streamed layers encoded (lossless; --encode-weights, by default for bf16 on CPU): "
                f"{format_size(weights_streamed)} of weights a token read as {format_size(streamed)}; against the "
                f"weights' bytes the I/O bound would be {weights_streamed / (gbps * 1e9):.3f} s"
                if weights_streamed != streamed
                else ""
            )
            + ". Read per token: ours, the layers its plan streams each pass (what its engine reads a step; "
            "tests/integration/test_generate.py holds it to exactly these); the others, what the block "
            "layer read for the process between its first and last token (/proc/self/io; page cache hits not "
            "counted)."
        )
    if kv_rows:
        comp = [r for r in kv_rows if r["phase"] == "compute" and r["rc"] == 0]
        back = [r for r in kv_rows if r["phase"] == "read_back" and r["rc"] == 0]
        if comp and back:
            same = all(b["token_ids"] == c["token_ids"] for c, b in zip(comp, back))
            tc, tb = median([r["ttft_s"] for r in comp]), median([r["ttft_s"] for r in back])
            lines += [
                "",
                f"Prompt cache, a prompt of {kv_rows[0]['prompt_tokens']} tokens (same model and budget, cap "
                f"{format_size(kv_rows[0].get('kv_cap_bytes', KV_CAP_GIB * 2**30))}; "
                f"{len({r['repeat'] for r in kv_rows})} repeats): "
                f"time to first token computing the prefix {tc:.1f} s, reading it back from the SSD {tb:.2f} s "
                f"(**{tc / tb:.1f}x faster**; {back[0]['reused_prefix_tokens']} tokens reused, "
                f"{format_size(back[0]['kv_cache']['bytes_read'])} read); next tokens identical: {same}.",
            ]
        else:
            lines += ["", f"Prompt cache runs failed: {[r.get('error', '')[-300:] for r in kv_rows if r['rc']]}"]
    # Each row keeps the command that measured it (the prompt cache is often measured again with --kv-only).
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
