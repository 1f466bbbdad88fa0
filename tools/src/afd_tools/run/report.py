"""The comparison table and the optional timeline plot of ``afd run``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from afd_tools.run.metrics import ModeSummary, mean


def print_report(summaries: Mapping[str, ModeSummary], ratios: Mapping[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="afd run: prefill, per mode")
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
            " ".join(f"{v:.0%}" for v in s.ffn_busy) if s.mode != "colocated" else "idle",
        )
    console = Console(width=140)
    console.print(table)
    for name, value in ratios.items():
        console.print(f"  {name}: {value:.2f}x")
    for s in summaries.values():
        if s.dummy_batches:
            console.print(
                f"  {s.mode}: {s.dummy_batches} dummy batches joined lockstep steps "
                f"(mean attention waiting {mean(s.attention_wait):.0%})"
            )


def write_plot(
    path: Path,
    summaries: Mapping[str, ModeSummary],
    replica_values: Sequence[Mapping[str, Any]],
    ffn_intervals: Sequence[Sequence[tuple[float, float, int, int]]],
    modes: Sequence[str],
) -> None:
    """One panel per mode, one row per rank, a bar per batch (attention) or item (FFN)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 2.2 * len(modes) + 0.6), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
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
