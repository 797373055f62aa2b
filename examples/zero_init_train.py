#!/usr/bin/env python3
"""Train a Llama with a plain DeepSpeed loop, as a user writes one; nothing here knows about aidaptiv.

    python examples/zero_init_train.py --config ds_configs/aidaptiv.json --steps 10
    deepspeed --num_accelerators 1 examples/zero_init_train.py --config ds_configs/zero_infinity.json

The model (by default the `tiny` shape of aidaptiv_ds.models.presets: hidden 768, 6 layers, 10,000-token vocabulary,
58M parameters, random weights) is built under ``deepspeed.zero.Init(config_dict_or_path=config)``, as
Hugging Face does with a ZeRO-3 config, then ``deepspeed.initialize`` and a loop of forward, backward and
step on random tokens. With an "aidaptiv" block in the config (and aidaptiv-ds installed, whose start-up
hook wraps deepspeed's two entry points) the parameters and optimizer state stream through our swapper;
with any other config this is plain DeepSpeed.

Each step's wall time is printed; --json-out also writes every step's forward, backward and step times,
the losses, peak RSS, this process's block-device bytes over the steps after --warmup (/proc/self/io) and,
when the engine has it, ``engine.aidaptiv_stats()``. Run without a launcher, it is rank 0 of 1.
"""

import argparse
import json
import os
import resource
import socket
import time

import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def proc_io():
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def single_process_env():
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="DeepSpeed config (JSON)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (10)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean and the I/O bytes (2)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (64)")
    p.add_argument("--hidden", type=int, default=768, help="hidden size (768)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (6)")
    p.add_argument("--heads", type=int, default=12, help="attention heads (12)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--intermediate", type=int, default=2048, help="MLP size (2048)")
    p.add_argument("--vocab", type=int, default=10000, help="vocabulary (10000)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json-out", default=None, help="write the per-step record here")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = p.parse_args()

    single_process_env()
    with open(args.config) as f:
        config = json.load(f)
    micro_batch = config.get("train_micro_batch_size_per_gpu", 1)
    torch.manual_seed(args.seed)
    deepspeed.init_distributed()
    model_config = LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(model_config)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    initialize_s = time.perf_counter() - t0
    # What start-up read from the swap files (our swapper's counter; None on other backends).
    init_stats = engine.aidaptiv_stats() if callable(getattr(engine, "aidaptiv_stats", None)) else None
    rank = int(os.environ.get("RANK", "0"))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    steps, losses, io_start = [], [], None
    engine.train()
    for step in range(args.steps):
        if step == args.warmup:
            io_start = proc_io()
        ids = torch.randint(0, args.vocab, (micro_batch, args.seq_len), device=engine.device)
        sync()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        engine.step()
        sync()
        t3 = time.perf_counter()
        steps.append({"step_s": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2})
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}, {t3 - t0:.3f} s", flush=True)
    io_end = proc_io()

    timed = steps[args.warmup :] or steps
    stats = engine.aidaptiv_stats() if callable(getattr(engine, "aidaptiv_stats", None)) else None
    record = {
        "config": args.config,
        "micro_batch": micro_batch,
        "seq_len": args.seq_len,
        "warmup": args.warmup,
        "params": sum(int(getattr(q, "ds_numel", q.numel())) for q in model.parameters()),
        "build_s": build_s,
        "initialize_s": initialize_s,
        "steps": steps,
        "losses": losses,
        "mean_step_s": sum(r["step_s"] for r in timed) / len(timed),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "io_bytes": ([e - s for s, e in zip(io_start, io_end)] if io_start and io_end else None),
        "io_steps": len(steps) - args.warmup if io_start else None,
        "aidaptiv_stats": stats,
        "initialize_read_bytes": init_stats["nvme_read_bytes"] if init_stats else None,
    }
    if rank == 0:
        print(f"mean step after {args.warmup} warm-up steps: {record['mean_step_s']:.3f} s")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(record, f, indent=1, default=str)
    engine.destroy()


if __name__ == "__main__":
    main()
