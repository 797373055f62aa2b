"""Published numbers to show beside ours, transcribed from the source documents in shared/seeds/.

Each point names its source, the system it was measured on and what ran (the aiDAPTIV+ product, plain
DeepSpeed ZeRO-3, Axolotl). Models are mapped to our preset names; where the source does not name the model
exactly, ``model_assumed`` is True and the note says why. Batches are as the sources state them; the C-DAC
paper's "batch size" is read as the per-GPU micro-batch (its 2-GPU throughput is about twice the 1-GPU one at
the same batch). Nothing here is measured by us, and nothing we measure is typed here.

Transcription is checked against the seed text by tests/unit/test_published.py when the seeds are present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

RUDRA = (
    "C-DAC PARAM Rudra node: 1-2x NVIDIA A100 40GB PCIe Gen3, 2x Xeon Gold 6240R (48 cores), 192 GB RAM, "
    "1x 2 TB MiPhi aiDAPTIV+ AI100E SSD (non-RAID)"
)
SIDDHI = (
    "C-DAC PARAM Siddhi AI node: 8x NVIDIA A100 40GB SXM4, 2x AMD EPYC 7742 (128 cores), 1 TB RAM, "
    "2x 2 TB MiPhi aiDAPTIV+ SSD (RAID 0)"
)
SIGNAL65 = "HP Z8 Fury G5: 4x NVIDIA RTX 6000 Ada 48 GB, Xeon w5-3435X, 512 GB DDR5, 2x Pascari AI100E M.2 2 TB"
PHISON = "Phison test system: Intel W5-3435X, 512 GB DDR5 (16x 4800MT), 2x Pascari AI100 2 TB (LVM RAID 0), Ubuntu 24"


@dataclass(frozen=True)
class Source:
    id: str
    citation: str
    """Document and table/figure."""
    system: str
    software: str
    notes: str = ""


@dataclass(frozen=True)
class Point:
    source: str
    model: Optional[str]
    """Our preset name, None when the source gives none."""
    seq_len: Optional[int]
    micro_batch: Optional[int]
    gpus: int
    status: str
    """ok (ran / completed) or oom (out of memory / does not fit)."""
    tokens_per_s: Optional[float] = None
    qualifier: str = "="
    """'=' a table value, '~' approximate, '>' the text says 'over', 'peak' a maximum over batch."""
    completion: Optional[str] = None
    """Wall time of the whole published job, h:mm:ss."""
    what: str = "aiDAPTIV+"
    """What ran: aiDAPTIV+ (the product), DeepSpeed ZeRO-3 (no offload), Axolotl."""
    gpu: Optional[str] = None
    """The GPU, when the source's system has several kinds."""
    grad_accum: Optional[int] = None
    model_assumed: bool = False
    note: str = ""

    @property
    def completion_s(self) -> Optional[int]:
        if self.completion is None:
            return None
        h, m, s = (int(x) for x in self.completion.split(":"))
        return h * 3600 + m * 60 + s


SOURCES = {
    s.id: s
    for s in [
        Source(
            "cdac-t6",
            "C-DAC, LLM Fine-Tuning with aiDAPTIV+ (seeds/003), Table VI",
            RUDRA,
            "MiPhi aiDAPTIV+ v2.0 kit, DeepSpeed, BF16, data set Cohere/miracl-zh-queries-22-12",
            "Tokens/s of Llama 2-7B and Llama 3.1-8B; OOM where the paper says so.",
        ),
        Source(
            "cdac-t5",
            "C-DAC (seeds/003), Table V / Figure 7",
            f"{SIDDHI}; and {RUDRA}",
            "MiPhi aiDAPTIV+ v2.0, max_seq_len 2048",
            "The paper does not name the model of Table V; Llama 2-7B is assumed (its Table VI row at batch 32, "
            "sequence 2048, 1093 / 1703 tokens/s, is close to Table V's batch 33 on Rudra, 1180 / 1739).",
        ),
        Source(
            "cdac-f8",
            "C-DAC (seeds/003), Figure 8 and its text",
            RUDRA,
            "MiPhi aiDAPTIV+ v2.0, Llama 3.1 70B, sequence 256, batch 1 to 80",
            "Only the peaks are given in the text. Its arithmetic is off: 10 billion tokens at 52.3 tokens/s take "
            "about 2,200 days, not the 2.22 days it states (that is 10 million tokens), and 86.9 / 52.3 is a 66.2% "
            "gain, not 65.9%.",
        ),
        Source(
            "cdac-t3",
            "C-DAC (seeds/003), Table III and Figure 1 text",
            SIDDHI,
            "DeepSpeed ZeRO-3, BF16, without MiPhi aiDAPTIV+",
            "Minimum GPU counts: 7B batch 4 at 2048 needs 4 GPUs, 13B batch 4 at 512 needs 7, 70B batch 1 does not "
            "fit on 8. Rows here: fewer GPUs than the minimum = oom, the minimum or more = ok (more GPUs shard "
            "more; the text says 7B scaled from 4 to 8 GPUs).",
        ),
        Source(
            "cdac-f2",
            "C-DAC (seeds/003), Figures 1-2 text",
            SIDDHI,
            "aiDAPTIV+ v1.05 (Figure 2) / DeepSpeed ZeRO-3 without MiPhi (Figure 1), sequence 2048",
            "Approximate values from the text; the figures' per-point numbers are not in the document.",
        ),
        Source(
            "signal65",
            "Signal65, Cost Efficient On-Premises AI Processing with Phison aiDAPTIV+ (seeds/000), Figures 1-2",
            SIGNAL65,
            "Phison aiDAPTIV Pro Suite 2.0.5 (with aiDAPTIV+) vs Axolotl (without); 1 epoch of a 672-sample creative "
            "writing set, max sequence 12,000, gradient accumulation 10, learning rate 7e-6",
            "Completion times only; no tokens/s is published (sample lengths are not given).",
        ),
        Source(
            "phison-001",
            "Phison, What is aiDAPTIV? (seeds/001), fine-tuning performance table",
            PHISON,
            "aiDAPTIV, 1 epoch, max sequence 12,000, total batch = GPUs x batch x 10, learning rate 7e-6, Triton on",
            "The model is only called '8B Model' (Llama 3.1 8B shape assumed). Times are read as h:mm:ss (the "
            "source writes 0.31:04 and 1:14.40); time x tokens/s is about 8.3 M tokens in every row, which agrees.",
        ),
    ]
}

# Table VI: {model: {seq: {batch: (1 GPU, 2 GPU)}}}; None = OOM.
_T6 = {
    "llama2-7b": {
        128: {8: (39, 84), 16: (66, 133), 24: (85, 171), 32: (100, 188)},
        256: {8: (78, 165), 16: (173, 259), 24: (167, 332), 32: (196, 362)},
        512: {8: (153, 324), 16: (254, 500), 24: (323, 629), 32: (371, 673)},
        1024: {8: (294, 611), 16: (476, 902), 24: (593, 1113), 32: (679, 1171)},
        2048: {8: (547, 1093), 16: (846, 1498), 24: (1000, 1732), 32: (1093, 1703)},
    },
    "llama3.1-8b": {
        128: {8: (35, 77), 16: (59, 127), 24: (75, 164), 32: (85, 189)},
        256: {8: (69, 154), 16: (117, 256), 24: (144, 321), 32: (171, 388)},
        512: {8: (137, 302), 16: (225, 479), 24: (282, 600), 32: (325, 677)},
        1024: {8: (265, 587), 16: (422, 871), 24: (None, None), 32: (None, None)},
        2048: {8: (488, 1028), 16: (None, None), 24: (None, None), 32: (None, None)},
    },
}


def _table_vi() -> list[Point]:
    pts = []
    for model, seqs in _T6.items():
        for seq, batches in seqs.items():
            for mb, pair in batches.items():
                for gpus, v in zip((1, 2), pair):
                    pts.append(Point("cdac-t6", model, seq, mb, gpus, "oom" if v is None else "ok", v))
    return pts


def _table_iii() -> list[Point]:
    pts = []
    for model, seq, mb, minimum in (("llama2-7b", 2048, 4, 4), ("llama2-13b", 512, 4, 7), ("llama2-70b", None, 1, 9)):
        for g in range(1, 9):
            pts.append(
                Point(
                    "cdac-t3",
                    model,
                    seq,
                    mb,
                    g,
                    "ok" if g >= minimum else "oom",
                    what="DeepSpeed ZeRO-3",
                    note="does not fit on 8 GPUs at any sequence" if minimum > 8 else f"minimum {minimum} GPUs",
                )
            )
    return pts


_T5_NOTE = "model not named in the paper (Llama 2-7B assumed)"

POINTS: list[Point] = (
    _table_vi()
    + _table_iii()
    + [
        # Table V (seq 2048): Siddhi and Rudra, batch 18 and 33 on 1 and 2 GPUs.
        *[
            Point("cdac-t5", "llama2-7b", 2048, mb, g, "ok", v, gpu=gpu, model_assumed=True, note=_T5_NOTE)
            for gpu, rows in (
                ("A100 40GB SXM4 (Siddhi)", ((1, 18, 1803), (1, 33, 1776), (2, 18, 3806), (2, 33, 3235))),
                ("A100 40GB PCIe Gen3 (Rudra)", ((1, 18, 914), (1, 33, 1180), (2, 18, 1451), (2, 33, 1739))),
            )
            for g, mb, v in rows
        ],
        # Figure 8: peaks over batch 1..80 at sequence 256 (batch of the 2-GPU peak not stated).
        Point("cdac-f8", "llama3.1-70b", 256, 80, 1, "ok", 52.3, qualifier="peak", note="peak, at batch 80"),
        Point(
            "cdac-f8",
            "llama3.1-70b",
            256,
            None,
            2,
            "ok",
            86.9,
            qualifier="peak",
            note="peak over batch 1-80 (batch not stated)",
        ),
        # Figures 1-2 text (Siddhi, sequence 2048).
        Point(
            "cdac-f2",
            "llama2-7b",
            2048,
            None,
            4,
            "ok",
            5000,
            qualifier="~",
            what="DeepSpeed ZeRO-3",
            note="Figure 1: ~5000 tokens/s at 4 GPUs",
        ),
        Point(
            "cdac-f2",
            "llama2-7b",
            2048,
            None,
            8,
            "ok",
            11000,
            qualifier=">",
            what="DeepSpeed ZeRO-3",
            note="Figure 1: over 11,000 tokens/s at 8 GPUs",
        ),
        Point(
            "cdac-f2",
            "llama2-13b",
            512,
            None,
            8,
            "ok",
            3000,
            qualifier="<",
            what="DeepSpeed ZeRO-3",
            note="Figure 1: under 3000 tokens/s (7-8 GPUs, sequence 512)",
        ),
        Point(
            "cdac-f2",
            "llama2-7b",
            2048,
            None,
            8,
            "ok",
            9000,
            qualifier=">",
            note="Figure 2: over 9000 tokens/s at 8 GPUs, batch ~32-33",
        ),
        Point(
            "cdac-f2",
            "llama2-13b",
            2048,
            None,
            8,
            "ok",
            5000,
            qualifier=">",
            note="Figure 2: 5000+ tokens/s at 8 GPUs, batch ~30-32",
        ),
        Point(
            "cdac-f2",
            "llama2-70b",
            2048,
            None,
            8,
            "ok",
            1000,
            qualifier=">",
            note="Figure 2: 1000+ tokens/s at 8 GPUs, batch 19-21; also trained on 1-2 GPUs",
        ),
        # Signal65 Figure 2: completion with aiDAPTIV+, out of memory without (Axolotl).
        *[
            Point("signal65", model, 12000, mb, g, "ok", completion=t, grad_accum=10)
            for model, mb, times in (
                ("llama3.1-8b", 18, ("1:08:20", "0:36:31", "0:20:42")),
                ("llama3.1-70b", 9, ("10:33:56", "5:30:44", "2:53:10")),
                ("qwen2.5-7b", 14, ("1:11:05", "0:38:45", "0:22:38")),
                ("qwen2.5-72b", 8, ("11:01:26", "5:54:04", "3:19:55")),
            )
            for g, t in zip((1, 2, 4), times)
        ],
        *[
            Point("signal65", model, 12000, mb, g, "oom", what="Axolotl", grad_accum=10)
            for model, mb in (("llama3.1-8b", 18), ("llama3.1-70b", 9), ("qwen2.5-7b", 14), ("qwen2.5-72b", 8))
            for g in (1, 2, 4)
        ],
        # Phison's own table (seeds/001), "8B Model", sequence 12,000, gradient accumulation 10.
        *[
            Point(
                "phison-001",
                "llama3.1-8b",
                12000,
                mb,
                g,
                "ok",
                v,
                completion=t,
                gpu=gpu,
                grad_accum=10,
                model_assumed=True,
                note="'8B Model'",
            )
            for gpu, g, t, v, mb in (
                ("RTX PRO 6000 Workstation 96 GB", 1, "0:31:04", 4481, 36),
                ("RTX PRO 6000 Max-Q 96 GB", 1, "0:40:28", 3402, 36),
                ("RTX 6000 Ada 48 GB", 1, "1:14:40", 1833, 24),
                ("RTX 6000 Ada 48 GB", 4, "0:25:05", 5498, 24),
                ("RTX 5000 Ada 32 GB", 1, "1:03:08", 2207, 16),
                ("RTX 5000 Ada 32 GB", 4, "0:20:03", 7282, 16),
                ("RTX 4000 Ada 20 GB", 1, "2:02:36", 1125, 8),
                ("RTX 4000 Ada 20 GB", 4, "0:33:07", 4313, 8),
                ("RTX 5090 32 GB", 1, "0:46:19", 3010, 16),
                ("RTX 5080 16 GB", 1, "1:29:27", 1528, 6),
                ("RTX 4070 Ti Super 16 GB", 1, "1:54:34", 1191, 6),
                ("RTX 4070 Ti Super 16 GB", 4, "0:32:24", 4226, 6),
            )
        ],
    ]
)


def matching(model: str, seq_len: int, micro_batch: int, gpus: int) -> list[Point]:
    """Published points for exactly this cell shape (model, sequence, batch, GPU count)."""
    return [
        p
        for p in POINTS
        if p.model == model and p.seq_len == seq_len and p.micro_batch == micro_batch and p.gpus == gpus
    ]


def label(p: Point) -> str:
    """Short column label: source, what ran, GPU kind."""
    s = SOURCES[p.source]
    base = {
        "cdac-t6": "C-DAC T.VI",
        "cdac-t5": "C-DAC T.V",
        "cdac-f8": "C-DAC F.8",
        "cdac-t3": "C-DAC T.III",
        "cdac-f2": "C-DAC F.1-2",
        "signal65": "Signal65",
        "phison-001": "Phison",
    }.get(p.source, s.id)
    gpu = p.gpu or {
        "cdac-t6": "A100 40GB PCIe",
        "cdac-f8": "A100 40GB PCIe",
        "cdac-t3": "A100 40GB SXM4",
        "cdac-f2": "A100 40GB SXM4",
        "signal65": "RTX 6000 Ada 48GB",
    }.get(p.source, "")
    return f"{base} {p.what}" + (f" ({gpu})" if gpu else "")
