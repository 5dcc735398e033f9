"""PNG plots of a comparison (matplotlib is optional: `pip install matplotlib`; without it plots are skipped).

tbt_cdf.png and ttft_cdf.png: CDFs per policy; batch_tokens.png: tokens in each batch over time, one
panel per policy; capacity.png: capacity per policy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from minisarathi.bench.metrics import BatchRecord, RequestRecord


def plot_comparison(
    runs: dict[str, tuple[list[RequestRecord], list[BatchRecord]]],
    capacities: dict[str, float] | None,
    out_dir: Path,
    title: str = "",
) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plots skipped (pip install matplotlib)", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        paths.append(out_dir / name)

    for name, what, values_of in (
        (
            "tbt_cdf.png",
            "time between tokens",
            lambda rs: [g for r in rs if r.completed for g in np.diff(r.token_times)],
        ),
        (
            "ttft_cdf.png",
            "time to first token",
            lambda rs: [r.token_times[0] - r.arrival for r in rs if r.completed and r.token_times],
        ),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for label, (requests, _) in runs.items():
            values = np.sort(np.asarray(values_of(requests)) * 1e3)
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{what} (ms, log scale)")
        ax.set_ylabel("fraction")
        ax.set_title(f"{what.capitalize()} CDF {title}".strip())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, name)

    fig, axes = plt.subplots(len(runs), 1, figsize=(6, 1.6 * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, (label, (_, batches)) in zip(axes[:, 0], runs.items()):
        starts = [b.start for b in batches]
        prefill = [b.prefill_tokens for b in batches]
        ax.vlines(starts, 0, prefill, color="tab:orange", linewidth=0.8, label="prefill")
        ax.vlines(
            starts, prefill, [b.num_tokens for b in batches], color="tab:blue", linewidth=0.8, label="decode"
        )
        ax.set_ylabel("tokens")
        ax.set_title(label, fontsize=9)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    save(fig, "batch_tokens.png")

    if capacities:
        fig, ax = plt.subplots(figsize=(6, 0.4 * len(capacities) + 1))
        labels = list(capacities)[::-1]  # first policy on top
        ax.barh(labels, [capacities[k] for k in labels], color="tab:green")
        ax.set_xlabel("capacity (queries/s)")
        ax.set_title("Capacity under the SLO")
        ax.tick_params(axis="y", labelsize=8)
        save(fig, "capacity.png")
    return paths
