"""One rank of a mixture-of-experts run whose router sends each rank's tokens to its own experts (rank r of 2 to
experts 4r .. 4r+3 of 8), under ZeRO-3 on CPU (gloo); prints one line ``RESULT {json}``: the losses, which
experts got tokens, the MoE blocks made ZeRO-3 leaves.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python moe_disjoint_run.py CONFIG LEAVES [STEPS]

The model has per-expert modules (each expert its own module in a ModuleList, transformers 4's layout and that of
models written by hand), where only the experts a rank's tokens chose run on that rank. LEAVES: ``mark`` (aidaptiv_ds.zero3.moe.mark_moe_blocks before initialize), ``none`` (nothing,
and DeepSpeed's default leaf classes off), or ``initialize`` (nothing here: aidaptiv_ds.initialize marks them
itself when the config has an aidaptiv block). The model is built whole on every rank from one seed and
partitioned by initialize; each rank trains on its own random tokens.
"""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, EXPERTS, TOP_K, FFN, LAYERS, SEQ = 256, 64, 8, 2, 128, 2, 32


def allowed_experts(rank: int) -> torch.Tensor:
    """This rank's half of the experts (a boolean row)."""
    mask = torch.zeros(EXPERTS, dtype=torch.bool)
    mask[rank * EXPERTS // 2 : (rank + 1) * EXPERTS // 2] = True
    return mask


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """A router and a ModuleList of experts; only the experts some token chose run."""

    def __init__(self, mask: torch.Tensor, hits: set):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.register_buffer("blocked", (~mask).float() * -1e4, persistent=False)
        self.hits = hits

    def forward(self, x):
        flat = x.reshape(-1, HIDDEN)
        weights, chosen = torch.topk(torch.softmax(self.gate(flat) + self.blocked, dim=-1), TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            self.hits.add(e)
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class Layer(nn.Module):
    def __init__(self, mask, hits):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = SparseMoeBlock(mask, hits)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class PerExpertLM(nn.Module):
    def __init__(self, mask, hits):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer(mask, hits) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), input_ids[:, 1:].reshape(-1))


def main() -> int:
    config_path, leaves = sys.argv[1:3]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    import deepspeed

    import aidaptiv_ds
    from aidaptiv_ds.zero3.moe import mark_moe_blocks

    with open(config_path) as f:
        cfg = json.load(f)
    if leaves == "none":
        cfg["zero_optimization"]["leaf_module"] = {"classes": []}  # DeepSpeed's default leaf classes off too
    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    mask, hits = allowed_experts(rank), set()
    torch.manual_seed(0)
    model = PerExpertLM(mask, hits)
    marked = mark_moe_blocks(model) if leaves == "mark" else []
    engine, *_ = aidaptiv_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    from deepspeed.utils import z3_leaf_module

    leaf_blocks = [n for n, m in engine.module.named_modules() if z3_leaf_module(m)]
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": rank,
                "losses": losses,
                "experts_hit": sorted(hits),
                "marked": marked,
                "leaf_blocks": leaf_blocks,
                "swapper": hasattr(engine, "aidaptiv_stats"),
            }
        ),
        flush=True,
    )
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
