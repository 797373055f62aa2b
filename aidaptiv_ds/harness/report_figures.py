"""The report's PNG figures of one model's cells (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from collections import defaultdict

from aidaptiv_ds.harness import published
from aidaptiv_ds.harness.grid import SWEEP_BACKENDS
from aidaptiv_ds.harness.report_tables import (
    SHORT,
    SYMBOL,
    _index,
    _order_backends,
    unit_of,
)


def _plots(model: str, rows: list[dict], fig_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    unit = unit_of(rows)
    backends = _order_backends(rows)
    colors = {b: c for b, c in zip(SWEEP_BACKENDS, ("tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:green"))}
    ok = [r for r in rows if r["status"] == "ok" and r["tokens_per_s"]]
    seqs = sorted({r["seq_len"] for r in rows})
    gpus = sorted({r["gpus"] for r in rows})
    mbs = sorted({r["micro_batch"] for r in rows})
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]

    def grid_axes(n):
        ncols = min(3, n)
        nrows = (n + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        return fig, list(axes.flat)

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(fig_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    if ok and len(mbs) > 1:
        fig, axes = grid_axes(len(seqs))
        for ax, seq in zip(axes, seqs):
            for b in backends:
                for i, g in enumerate(gpus):
                    pts = sorted(
                        (r["micro_batch"], r["tokens_per_s"])
                        for r in ok
                        if r["backend"] == b and r["gpus"] == g and r["seq_len"] == seq
                    )
                    if pts:
                        ax.plot(
                            *zip(*pts),
                            styles[i % 4],
                            marker=markers[i % 8],
                            color=colors.get(b),
                            label=f"{SHORT.get(b, b)}, {g} {unit}",
                        )
            pub = defaultdict(list)
            for p in published.POINTS:
                if (
                    p.model == model
                    and p.seq_len == seq
                    and p.micro_batch
                    and p.tokens_per_s
                    and p.gpus in gpus
                    and p.qualifier == "="
                ):
                    pub[(published.label(p), p.gpus)].append((p.micro_batch, p.tokens_per_s))
            for k, ((lab, g), pp) in enumerate(sorted(pub.items())):
                ax.plot(
                    *zip(*sorted(pp)), "x+12348"[k % 7], color="black", markersize=7, label=f"published: {lab}, {g} GPU"
                )
            ax.set_title(f"{model}, seq {seq}")
            ax.set_xlabel(f"micro-batch per {unit}")
            ax.set_ylabel("tokens/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        save(fig, f"{model}_tput_vs_batch.png")

    if ok and len(gpus) > 1:
        fig, axes = grid_axes(len(seqs))
        for ax, seq in zip(axes, seqs):
            for b in backends:
                for j, mb in enumerate(mbs):
                    pts = sorted(
                        (r["gpus"], r["tokens_per_s"])
                        for r in ok
                        if r["backend"] == b and r["micro_batch"] == mb and r["seq_len"] == seq
                    )
                    if pts:
                        ax.plot(
                            *zip(*pts),
                            styles[j % 4],
                            marker=markers[j % 8],
                            color=colors.get(b),
                            label=f"{SHORT.get(b, b)}, batch {mb}",
                        )
            ax.set_title(f"{model}, seq {seq}")
            ax.set_xlabel("GPUs" if unit == "GPU" else "processes (CPU)")
            ax.set_ylabel("tokens/s")
            ax.set_xticks(gpus)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
        save(fig, f"{model}_tput_vs_gpus.png")

    # Feasibility: one panel per backend x GPU count, sequence x batch coloured by status.
    from matplotlib.colors import ListedColormap

    codes = {"ok": 0, "oom*": 1, "oom": 2, "timeout": 3, "error": 4}
    cmap = ListedColormap(["#4caf50", "#ffcdd2", "#e53935", "#ff9800", "#7e57c2"])
    idx = _index(rows)
    ga = max({r["grad_accum"] for r in rows}, key=lambda a: sum(1 for r in rows if r["grad_accum"] == a))
    fig, axes = plt.subplots(
        len(backends),
        len(gpus),
        figsize=(max(6.0, 1.2 + 0.7 * len(mbs) * len(gpus)), 1.0 + 0.5 * (len(seqs) + 1) * len(backends)),
        squeeze=False,
    )
    import numpy as np

    for i, b in enumerate(backends):
        for j, g in enumerate(gpus):
            ax = axes[i][j]
            data = np.full((len(seqs), len(mbs)), np.nan)
            for si, seq in enumerate(seqs):
                for mi, mb in enumerate(mbs):
                    r = idx.get((b, g, seq, mb, ga))
                    if r is not None:
                        k = r["status"] + ("*" if r.get("inferred") else "")
                        data[si, mi] = codes[k]
                        ax.text(
                            mi,
                            si,
                            SYMBOL[r["status"]] + ("*" if r.get("inferred") else ""),
                            ha="center",
                            va="center",
                            fontsize=7,
                        )
            ax.imshow(data, cmap=cmap, vmin=0, vmax=4, aspect="auto")
            ax.set_xticks(range(len(mbs)), [str(m) for m in mbs], fontsize=7)
            ax.set_yticks(range(len(seqs)), [str(s) for s in seqs], fontsize=7)
            ax.set_title(f"{SHORT.get(b, b)}, {g} {unit}", fontsize=8)
            if i == len(backends) - 1:
                ax.set_xlabel("batch", fontsize=7)
            if j == 0:
                ax.set_ylabel("seq", fontsize=7)
    fig.suptitle(f"{model}: which cells ran\n✓ ok, ✗ OOM, ✗* inferred OOM, E error, T timeout", fontsize=9)
    save(fig, f"{model}_feasibility.png")
    return made
