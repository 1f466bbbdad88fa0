"""``afd sim sweep``: A:F ratios and GPU counts for one model and workload.

For each GPU count ``G`` and each A:F split of it (the ratios asked for, or every split),
the async and sync AFD deployments are simulated on the same requests, and colocated
DP+EP once on all ``G`` ranks. Per GPU count the report names the best split for each
AFD mode (highest tokens/s) and the ratios of async to sync and to colocated at their
best.

With ``ffn_shares`` (a calibration measured under CUDA MPS), the ``G`` ranks share one GPU
instead: each split is tried at each FFN share (percent of the SMs per FFN rank), the A
attention ranks sharing the rest equally -- the SM split is AFD's lever on one GPU, as
the A:F ratio is on many.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from afd_models import DeepseekConfig
from afd_tools.prefill.workload import Request, assign
from afd_tools.sim.costs import Calibration, SimError, Wire
from afd_tools.sim.simulate import deployment, headline, simulate_mode


@dataclass(frozen=True)
class Point:
    """One simulated configuration."""

    gpus: int
    attention_ranks: int
    ffn_ranks: int
    mode: str
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    makespan_s: float
    attention_share: float | None = None
    """Percent of one GPU's SMs per attention rank (None: a GPU each)."""
    ffn_share: float | None = None

    @property
    def split(self) -> str:
        ratio = f"{self.attention_ranks}:{self.ffn_ranks}"
        if self.attention_share is None or self.ffn_share is None:
            return ratio
        return f"{ratio} ({self.attention_share:.4g} % / {self.ffn_share:.4g} %)"


def share_splits(
    attention_ranks: int, ffn_ranks: int, ffn_shares: Sequence[float] | None
) -> list[tuple[float | None, float | None]]:
    """(attention share, FFN share) pairs to try for A:F on one GPU: each of
    ``ffn_shares`` with the attention ranks sharing the rest of the SMs equally (pairs that
    leave the attention ranks under 1 % dropped); ``[(None, None)]`` without shares."""
    if ffn_shares is None:
        return [(None, None)]
    out: list[tuple[float | None, float | None]] = []
    for share in ffn_shares:
        left = (100.0 - ffn_ranks * share) / attention_ranks
        if left >= 1.0:
            out.append((left, share))
    return out


def parse_shares(text: str) -> list[float]:
    """``"25,33.3,50"`` -> FFN shares in percent; :class:`SimError` on a bad entry."""
    out = []
    for part in text.split(","):
        try:
            share = float(part)
        except ValueError:
            share = float("nan")
        if not 0 < share < 100:
            raise SimError(f"--ffn-shares: {part.strip()!r} is not a percent in (0, 100)")
        out.append(share)
    return out


def parse_ratios(text: str) -> list[Fraction]:
    """``"1:3,1:1,3:1"`` -> A/F fractions; :class:`SimError` on a bad entry."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            a, f = (int(x) for x in part.split(":"))
        except ValueError:
            raise SimError(f"--ratios: {part!r} is not A:F (two whole numbers)") from None
        if a < 1 or f < 1:
            raise SimError(f"--ratios: {part!r} needs A >= 1 and F >= 1")
        out.append(Fraction(a, f))
    return out


def splits(gpus: int, ratios: Sequence[Fraction] | None) -> list[tuple[int, int]]:
    """The (A, F) with A + F = ``gpus`` whose A/F is one of ``ratios`` (every split when
    ``ratios`` is None)."""
    out = []
    for a in range(1, gpus):
        f = gpus - a
        if ratios is None or Fraction(a, f) in ratios:
            out.append((a, f))
    return out


def sweep(
    config: DeepseekConfig,
    calibration: Calibration,
    lengths: Sequence[int],
    arrivals: Sequence[float],
    *,
    gpus: Sequence[int],
    ratios: Sequence[Fraction] | None,
    budget: int,
    stages: int,
    wire: Wire,
    modes: Sequence[str],
    policy: str = "round-robin",
    ffn_batch: int = 1,
    progress: Callable[[], None] | None = None,
    min_stage_tokens: int = 0,
    ffn_shares: Sequence[float] | None = None,
    attention_share: float | None = None,
    ffn_share: float | None = None,
) -> list[Point]:
    """Every configuration's simulated figures (``ffn_shares``: the module docstring)."""
    if ffn_shares is not None and "colocated" in modes:
        raise SimError(
            "--ffn-shares: on one GPU the colocated baseline is the monolithic model on the "
            "whole GPU, which the simulator does not model; use --modes async,sync"
        )
    jobs = _jobs(gpus, ratios, modes, ffn_shares)
    points = []
    for g, a, f, mode, shares in jobs:
        if shares == (None, None):
            shares = (attention_share, ffn_share)  # fixed for every split, or None
        dep = deployment(
            config,
            calibration,
            attention_ranks=a,
            ffn_ranks=f,
            budget=budget,
            stages=stages,
            min_stage_tokens=min_stage_tokens,
            colocated="dp-ep",
            ffn_batch=ffn_batch,
            wire=wire,
            attention_share=shares[0],
            ffn_share=shares[1],
        )
        requests: list[Request] = assign(lengths, arrivals, a, policy)
        s = headline(simulate_mode(dep, mode, requests, policy))
        points.append(
            Point(
                g,
                a,
                f,
                mode,
                s.tokens_per_s,
                s.ttft_p50,
                s.ttft_p99,
                s.makespan_s,
                *shares,
            )
        )
        if progress is not None:
            progress()
    return points


Job = tuple[int, int, int, str, tuple[float | None, float | None]]


def _jobs(
    gpus: Sequence[int],
    ratios: Sequence[Fraction] | None,
    modes: Sequence[str],
    ffn_shares: Sequence[float] | None,
) -> list[Job]:
    """(G, A, F, mode, shares) of every configuration; :class:`SimError` for a GPU count
    with nothing to simulate."""
    jobs: list[Job] = []
    for g in gpus:
        if g < 2:
            raise SimError(f"--gpus: {g} is too few (AFD needs an attention and an FFN GPU)")
        chosen = splits(g, ratios)
        if not chosen and any(m != "colocated" for m in modes):
            raise SimError(f"--gpus {g}: none of the --ratios splits {g} GPUs evenly")
        for a, f in chosen:
            pairs = share_splits(a, f, ffn_shares)
            if not pairs:
                raise SimError(
                    f"--ffn-shares: at {a}:{f} every share leaves each attention rank under "
                    f"1 % of the GPU; give smaller FFN shares"
                )
            jobs += [(g, a, f, m, pair) for pair in pairs for m in modes if m != "colocated"]
        if "colocated" in modes:
            jobs.append((g, max(1, g // 2), g - max(1, g // 2), "colocated", (None, None)))
    return jobs


def count_jobs(
    gpus: Sequence[int],
    ratios: Sequence[Fraction] | None,
    modes: Sequence[str],
    ffn_shares: Sequence[float] | None = None,
) -> int:
    return len(_jobs(gpus, ratios, modes, ffn_shares))


def best(points: Sequence[Point]) -> list[dict[str, Any]]:
    """Per GPU count: the best split per mode and the async ratios."""
    rows = []
    for g in sorted({p.gpus for p in points}):
        here = [p for p in points if p.gpus == g]
        row: dict[str, Any] = {"gpus": g}
        for mode in ("async", "sync", "colocated"):
            of_mode = [p for p in here if p.mode == mode]
            if of_mode:
                top = max(of_mode, key=lambda p: p.tokens_per_s)
                row[mode] = asdict(top) | {"split": top.split}
        if "async" in row and "sync" in row:
            row["async/sync"] = row["async"]["tokens_per_s"] / row["sync"]["tokens_per_s"]
        if "async" in row and "colocated" in row:
            row["async/colocated"] = row["async"]["tokens_per_s"] / row["colocated"]["tokens_per_s"]
        rows.append(row)
    return rows


def markdown(rows: Sequence[dict[str, Any]], count: str = "GPUs") -> str:
    """The best-per-mode table (Markdown, also printed); ``count`` heads the first column
    (``ranks on one GPU`` for a sweep of one GPU's splits)."""
    lines = [
        f"| {count} | best async A:F | async tokens/s | async TTFT p50 s | best sync A:F | sync "
        "tokens/s | colocated tokens/s | async/sync | async/colocated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:

        def cell(mode: str, key: str, fmt: str, row: dict[str, Any] = r) -> str:
            return format(row[mode][key], fmt) if mode in row else "-"

        lines.append(
            f"| {r['gpus']} | {r['async']['split'] if 'async' in r else '-'} | "
            f"{cell('async', 'tokens_per_s', ',.0f')} | {cell('async', 'ttft_p50', '.2f')} | "
            f"{r['sync']['split'] if 'sync' in r else '-'} | "
            f"{cell('sync', 'tokens_per_s', ',.0f')} | "
            f"{cell('colocated', 'tokens_per_s', ',.0f')} | "
            f"{format(r['async/sync'], '.2f') + 'x' if 'async/sync' in r else '-'} | "
            f"{format(r['async/colocated'], '.2f') + 'x' if 'async/colocated' in r else '-'} |"
        )
    return "\n".join(lines)


def attention_fraction(point: Point) -> float:
    """The attention side's share of the hardware: A / (A + F) GPUs, or of one GPU's SMs."""
    if point.attention_share is None:
        return point.attention_ranks / point.gpus
    return point.attention_ranks * point.attention_share / 100.0


def write_plot(path: Path, points: Sequence[Point], title: str, one_gpu: bool = False) -> None:
    """Left: tokens/s per GPU of the best split per mode against GPU count; right: every
    split's async and sync tokens/s against its attention share A/(A+F). With ``one_gpu``
    (a sweep of one GPU's splits) the counts are ranks on that GPU and tokens/s are the
    GPU's."""
    per = (lambda g: 1) if one_gpu else (lambda g: g)
    unit = "ranks on one GPU" if one_gpu else "GPUs"
    rate = "tokens/s" if one_gpu else "tokens/s per GPU"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"async": "tab:blue", "sync": "tab:orange", "colocated": "tab:green"}
    for mode, color in colors.items():
        xs, ys = [], []
        for g in sorted({p.gpus for p in points}):
            of = [p for p in points if p.gpus == g and p.mode == mode]
            if of:
                xs.append(g)
                ys.append(max(p.tokens_per_s for p in of) / per(g))
        if xs:
            left.plot(xs, ys, "o-", color=color, label=f"{mode} (best split)")
    if not one_gpu:
        left.set_xscale("log", base=2)
    left.set_xlabel(unit)
    left.set_ylabel(rate)
    left.legend()
    left.set_title("best A:F per mode")
    for g in sorted({p.gpus for p in points}):
        for mode in ("async", "sync"):
            of = sorted(
                (p for p in points if p.gpus == g and p.mode == mode),
                key=attention_fraction,
            )
            if of:
                right.plot(
                    [attention_fraction(p) for p in of],
                    [p.tokens_per_s / per(g) for p in of],
                    "-" if mode == "async" else "--",
                    marker=".",
                    label=f"{mode}, {g} {unit}",
                )
    right.set_xlabel("attention's share: A / (A + F), or of one GPU's SMs with --ffn-shares")
    right.set_ylabel(rate)
    right.legend(fontsize=7, ncol=2)
    right.set_title("every split (solid async, dashed sync)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
