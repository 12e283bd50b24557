"""PNG of a planner sweep: memory, communication and predicted tokens/s vs sequence length.

matplotlib is optional: ``plot_sweep`` returns None when it is not installed."""

from __future__ import annotations

import math
from typing import List, Optional

GB = 1e9


def plot_sweep(sweep: dict, seqs: List[int], plan: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    hw, m = plan["hardware"], plan["model"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for label, rows in sweep.items():
        style = "-" if rows[0]["kind"] == "tsp" else "--"
        axes[0].plot(
            seqs,
            [r["memory_total_bytes"][r["recompute"]] / GB for r in rows],
            style,
            marker="o",
            ms=3,
            label=label,
        )
        axes[1].plot(
            seqs,
            [(r["layer_comm_fwd"] + r["layer_comm_bwd"]) / GB for r in rows],
            style,
            marker="o",
            ms=3,
            label=label,
        )
        axes[2].plot(
            seqs, [r["tokens_per_s"] / 1e6 for r in rows], style, marker="o", ms=3, label=label
        )
    axes[0].axhline(hw.hbm_gb, color="k", lw=0.8, ls=":", label=f"HBM {hw.hbm_gb} GB")
    axes[0].set_ylabel("memory per GPU [GB] (recompute auto)")
    axes[1].set_ylabel("received bytes per layer fwd+bwd [GB]")
    axes[2].set_ylabel(f"predicted tokens/s on {plan['gpus']} x {hw.name} [M]")
    marks = []
    cross = plan.get("bytes_crossover_seq")  # dense models: TSP's bytes against TP+SP's
    if cross:
        marks += [
            (cross["fwd"], "TSP vs TP+SP bytes crossover fwd", "tab:red"),
            (cross["total"], "TSP vs TP+SP bytes crossover fwd+bwd", "tab:purple"),
        ]
    if plan.get("moe_ring_crossover_seq"):  # MoE models: the expert ring against all-to-all
        marks.append((plan["moe_ring_crossover_seq"], "expert ring vs alltoall bytes", "tab:red"))
    if plan.get("throughput_crossover_seq"):
        marks.append(
            (plan["throughput_crossover_seq"], "TSP vs TP+SP tokens/s crossover", "tab:green")
        )
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.axvline(plan["seq"], color="gray", lw=0.8)
        for x, txt, col in marks:
            if x and math.isfinite(x) and seqs[0] <= x <= seqs[-1]:
                ax.axvline(x, color=col, lw=1, ls="-.", label=f"{txt} S={x:,.0f}")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"megatron-tsp plan: {m.name}, D={plan['degree']}, micro-batch "
        f"{plan['options'].micro_batch}, {hw.name} (analytic model; see printed assumptions)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
