"""The comparison table and the optional timeline plot of ``afd run``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from afd_tools.prefill.metrics import ModeSummary, ReplicaTimes, mean


def print_report(
    summaries: Mapping[str, ModeSummary],
    ratios: Mapping[str, float],
    title: str = "afd run: prefill, per mode",
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in (
        "mode",
        "TTFT p50 s",
        "TTFT p90 s",
        "TTFT p99 s",
        "tokens/s",
        "makespan s",
        "attention busy",
        "attention waiting",
        "FFN busy",
    ):
        table.add_column(column, justify="right")
    for s in summaries.values():
        table.add_row(
            s.mode,
            f"{s.ttft_p50:.3f}",
            f"{s.ttft_p90:.3f}",
            f"{s.ttft_p99:.3f}",
            f"{s.tokens_per_s:.0f}",
            f"{s.makespan_s:.2f}",
            " ".join(f"{v:.0%}" for v in s.attention_busy),
            " ".join(f"{v:.0%}" for v in s.attention_wait),
            _ffn_busy(s),
        )
    console = Console(width=140)
    console.print(table)
    timed = [s for s in summaries.values() if not s.breakdown.empty]
    if timed:
        layers = Table(title="per MoE layer, mean over attention ranks (ms)")
        columns = ("mode", "compute", "dispatch", "combine (incl. wait)", "barrier", "FFN per item")
        for column in columns:
            layers.add_column(column, justify="right")
        for s in timed:
            b = s.breakdown
            layers.add_row(
                s.mode,
                *(
                    "-" if v is None else f"{v:.3f}"
                    for v in (
                        b.compute_ms_per_layer,
                        b.dispatch_ms_per_layer,
                        b.combine_ms_per_layer,
                        b.barrier_ms_per_layer,
                        b.ffn_ms_per_item,
                    )
                ),
            )
        console.print(layers)
        console.print(
            "  compute: everything between the endpoint calls (attention, dense layers, router, "
            "local shared experts); barrier: sync mode's wait for the other replicas (on a GPU, "
            "the device's idle time at it); "
            "dispatch in colocated dp-ep: "
            "the collectives and the local experts"
        )
    for name, value in ratios.items():
        console.print(f"  {name}: {value:.2f}x")
    for s in summaries.values():
        if s.dummy_batches:
            console.print(
                f"  {s.mode}: {s.dummy_batches} dummy batches joined lockstep steps "
                f"(mean attention waiting {mean(s.attention_wait):.0%})"
            )


def _ffn_busy(s: ModeSummary) -> str:
    if s.mode == "colocated":  # the FFN processes idle (dp), or there are none (dp-ep)
        return "idle" if s.ffn_busy else "-"
    return " ".join(f"{v:.0%}" for v in s.ffn_busy)


Outcome = tuple[Sequence[str], Sequence[Any], Sequence[Mapping[str, ReplicaTimes]], Sequence[Any]]
"""One launch's (modes, requests, per-replica results by mode, per-FFN-rank intervals)."""


def write_plot(
    path: Path, summaries: Mapping[str, ModeSummary], outcomes: Sequence[Outcome]
) -> None:
    """One panel per mode, one row per rank, a bar per batch (attention) or item (FFN)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (mode, values, intervals)
        for modes, _, values, intervals in outcomes
        for mode in modes
        if mode in summaries
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.2 * len(panels) + 0.6), squeeze=False)
    for ax, (mode, replica_values, ffn_intervals) in zip(axes[:, 0], panels, strict=True):
        results = [values[mode] for values in replica_values]
        origin = min(r.origin for r in results)
        labels = []
        for row, result in enumerate(results):
            spans = [(s, e - s) for s, e, _ in result.batches]
            ax.broken_barh(spans, (row - 0.4, 0.8), color="tab:blue")
            labels.append(f"attention {row}")
        for f, intervals in enumerate(ffn_intervals):
            row = len(results) + f
            end = origin + summaries[mode].makespan_s
            spans = [(s - origin, e - s) for s, e, *_ in intervals if origin <= s <= end]
            ax.broken_barh(spans, (row - 0.4, 0.8), color="tab:orange")
            labels.append(f"FFN {f}")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_title(f"{mode}: {summaries[mode].tokens_per_s:.0f} tokens/s")
        ax.set_xlim(0, summaries[mode].makespan_s * 1.02)
    axes[-1, 0].set_xlabel("seconds since the mode started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
