"""A stand-in for ``aidaptiv-ds train`` that speaks its command-line and metrics contract, so the sweep
harness can be tested in seconds without DeepSpeed training.

Run by the deepspeed launcher as ``--module fake_train`` (tests put tests/fakes on PYTHONPATH and set
AIDAPTIV_DS_TRAIN_MODULE=fake_train). It rejects any flag the contract does not have. What it does is
chosen per micro-batch by FAKE_TRAIN_PLAN, a JSON object {"<micro_batch>": behaviour} (default "ok"):

  ok            sleep FAKE_STEP_S per step, write status ok metrics, exit 0
  alloc:MB      touch MB MiB of memory and hold it 60 s (a cap should kill it first), then behave as ok
  hang          sleep forever
  crash         raise RuntimeError (exit 1, traceback on stderr)
  oom           print a CUDA OOM message, write status oom metrics, exit 3
  oom_silent    print a CUDA OOM traceback line and exit 3 without metrics
  segv          kill itself with SIGSEGV
  ok_then_fail  write ok metrics, then exit 1
"""

import argparse
import json
import os
import signal
import sys
import time


def parse():
    p = argparse.ArgumentParser(prog="fake_train")
    for flag in ("--config", "--model", "--nvme-path", "--metrics-out"):
        p.add_argument(flag, required=True)
    for flag in ("--seq-len", "--micro-batch", "--grad-accum", "--steps", "--warmup"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--gpu-mem-cap-gb", type=float)
    p.add_argument("--host-budget", type=int)  # the sweep gives aidaptiv cells their budget
    p.add_argument("--create-nvme-path", action="store_true")
    args = p.parse_args()
    if args.create_nvme_path:
        os.makedirs(args.nvme_path, mode=0o700, exist_ok=True)
    return args


def write_metrics(args, status, error=None, steps=None):
    if os.environ.get("RANK", "0") != "0":
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    step_s = steps or [0.1] * args.steps
    timed = step_s[args.warmup :]
    med = sorted(timed)[len(timed) // 2] if timed else None
    tokens = args.micro_batch * args.seq_len * args.grad_accum * world
    m = {
        "status": status,
        "error": error,
        "tokens_per_s": tokens / med if (med and status == "ok") else None,
        "step_s_median": med if status == "ok" else None,
        "step_s": step_s,
        "losses": [10.0 - 0.1 * i for i in range(len(step_s))],
        "peak_rss_mb": 123.0,
        "peak_pinned_mb": 4.0,
        "peak_gpu_mb": None,
        "nvme_read_bytes": 3_000_000 * len(timed),
        "nvme_write_bytes": 1_000_000 * len(timed),
        "phases_s": {"forward": 0.03, "backward": 0.05, "optimizer": 0.02, "io_wait": 0.01},
        "params": 1234567,
        "model": args.model,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "grad_accum": args.grad_accum,
        "world_size": world,
        "steps": args.steps,
        "warmup": args.warmup,
        "backend": os.path.splitext(os.path.basename(args.config))[0],
        "argv": sys.argv[1:],
    }
    tmp = args.metrics_out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(m, f)
    os.replace(tmp, args.metrics_out)


def main():
    args = parse()
    plan = json.loads(os.environ.get("FAKE_TRAIN_PLAN", "{}"))
    what = plan.get(str(args.micro_batch), "ok")
    os.makedirs(args.nvme_path, exist_ok=True)
    with open(os.path.join(args.nvme_path, f"swap.rank{os.environ.get('RANK', '0')}"), "wb") as f:
        f.write(b"\0" * 4096)  # the harness must remove the swap folder afterwards
    step_s = float(os.environ.get("FAKE_STEP_S", "0.02"))
    if what.startswith("alloc:"):
        mb = int(what.split(":", 1)[1])
        hold = bytearray(mb << 20)
        for i in range(0, len(hold), 4096):
            hold[i] = 1  # touch every page so it is resident
        time.sleep(60)
        what = "ok"
    if what == "hang":
        while True:
            time.sleep(3600)
    if what == "crash":
        raise RuntimeError("fake crash in layer 3: tensor shape mismatch")
    if what == "oom":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        write_metrics(args, "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        sys.exit(3)
    if what == "oom_silent":
        print("RuntimeError: CUDA error: out of memory", file=sys.stderr)
        sys.exit(3)
    if what == "segv":
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSEGV)
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        time.sleep(step_s)
        steps.append(time.perf_counter() - t)
    write_metrics(args, "ok", steps=steps)
    if what == "ok_then_fail":
        print("RuntimeError: NCCL teardown failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
