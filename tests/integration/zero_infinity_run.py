"""One ZeRO-Infinity training run on CPU (ZeRO-3, parameters and optimizer state on NVMe, gloo, 1 process):
a small Llama with random weights from a fixed seed, a few steps; prints {"losses": [...], ...} as JSON.

    python zero_infinity_run.py --nvme-dir DIR [--aidaptiv] [--steps N]

--aidaptiv installs our aio_handle (aidaptiv_ds.zero3.aio_builder.install) before DeepSpeed builds its
swappers; without it DeepSpeed's libaio handle does the I/O. Nothing else differs between the two runs.
The settings ZeRO-Infinity needs to run at all here (deepspeed 0.19.8):
- offload_param.max_in_cpu 0: otherwise every parameter is copied into RAM and nothing is read from NVMe;
- stage3_max_reuse_distance 0 and stage3_prefetch_bucket_size 0: the defaults run out of swap buffers
  ("Not enough buffers 0 for swapping 1") or prefetch a parameter twice and assert;
- buffer_size above the largest partition, buffer_count 5 (params) / 4 (optimizer, not pipelined);
- no zero.Init(dtype=...) (it gives bf16 on a CPU without fp16); the engine partitions the fp32 model;
- engine.destroy() before exit.
"""

import argparse
import json
import os
import random
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvme-dir", required=True)
    parser.add_argument("--aidaptiv", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + random.Random(os.getpid()).randrange(2000)))

    import deepspeed
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.aidaptiv:
        from aidaptiv_ds.zero3 import aio_builder

        aio_builder.install()

    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    torch.use_deterministic_algorithms(True)
    # Partitions of the embedding, lm_head and MLP weights are >= 1 MiB in fp32, so DeepSpeed swaps them
    # (it keeps smaller tensors in RAM).
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    largest = max(p.numel() for p in model.parameters())

    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": args.nvme_dir,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": largest + 4096,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_dir, "pin_memory": True, "buffer_count": 4},
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_param_persistence_threshold": 0,
        },
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "wall_clock_breakdown": False,
    }
    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def name(obj):
        return type(obj).__module__ + "." + type(obj).__name__

    optimizer_swapper = engine.optimizer.optimizer_swapper
    param_swapper = next(
        p.nvme_swapper for p in engine.module.parameters() if getattr(p, "nvme_swapper", None) is not None
    )
    handles = {
        "optimizer": optimizer_swapper.aio_handle,
        "param_read": param_swapper.aio_read_handle,
        "param_write": param_swapper.aio_write_handle,
    }
    gen = torch.Generator().manual_seed(99)
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (2, 64), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    swap_files = sum(len(files) for _, _, files in os.walk(args.nvme_dir))
    result = {"losses": losses, "handles": {k: name(h) for k, h in handles.items()}, "swap_files": swap_files}
    if args.aidaptiv:  # how much went through our engine, to show the swappers really used it
        result["bytes_read"] = {k: h._engine.stats()["bytes_read"] for k, h in handles.items()}
        result["bytes_written"] = {k: h._engine.stats()["bytes_written"] for k, h in handles.items()}
    engine.destroy()
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
