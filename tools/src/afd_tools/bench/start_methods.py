"""``afd bench transport --start-method A --start-method B``: one benchmark under each way
of starting rank processes, side by side in one run.

afd's launcher forks ranks from a fork server that imported torch (its default on CPU) or
spawns fresh interpreters (its default for GPU ranks since this benchmark measured them
faster per layer; ``AFD_START_METHOD`` picks either). A per-layer figure that moved between two
runs a day apart -- the NVSHMEM dispatch's host time, 0.67 then 1.04 ms at 1K tokens, with
the fork server landed in between -- is settled by measuring both in one run: the whole
benchmark runs once per method in turn, ``rounds`` times (A, B, A, B, ...), and a table
gives every per-layer figure of the report (its ``layer`` object, flattened) by method: the
median over the rounds, each method's range, and the ratio to the first method.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Iterator
from typing import Any

from afd_protocol.launch import START_METHOD_ENV


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a JSON-like tree, by its path (``a/b/c``); booleans are not numbers."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(tree, int | float) and not isinstance(tree, bool):
        yield prefix, float(tree)


def compare_start_methods(
    measure: Callable[[], dict[str, Any]], methods: list[str], rounds: int
) -> dict[str, Any]:
    """Run ``measure`` under each of ``methods`` in turn, ``rounds`` times; print the table
    and return ``{"start_methods": {method: [report, ...]}, "summary": {...}}``. The
    launcher's variable is restored afterwards, whatever happens."""
    methods = list(dict.fromkeys(methods))
    reports: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    saved = os.environ.get(START_METHOD_ENV)
    try:
        for round_ in range(rounds):
            for method in methods:
                print(
                    f"\n=== start method {method}, round {round_ + 1} of {rounds} ===", flush=True
                )
                os.environ[START_METHOD_ENV] = method
                reports[method].append(measure())
    finally:
        if saved is None:
            os.environ.pop(START_METHOD_ENV, None)
        else:
            os.environ[START_METHOD_ENV] = saved
    summary = summarize(reports)
    print_summary(summary, methods, rounds)
    return {"start_methods": reports, "summary": summary}


def summarize(reports: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per per-layer figure: each method's median, low and high over its rounds."""
    figures: dict[str, dict[str, list[float]]] = {}
    for method, runs in reports.items():
        for report in runs:
            for path, value in leaves(report.get("layer", {})):
                figures.setdefault(path, {}).setdefault(method, []).append(value)
    return {
        path: {
            method: {
                "median": statistics.median(values),
                "low": min(values),
                "high": max(values),
            }
            for method, values in by_method.items()
        }
        for path, by_method in figures.items()
    }


def print_summary(summary: dict[str, dict[str, Any]], methods: list[str], rounds: int) -> None:
    first = methods[0]
    print(
        f"\nevery per-layer figure by start method (median over {rounds} round(s), low-high; "
        f"ratio = method / {first})"
    )
    header = f"  {'figure':<40}" + "".join(f" {m:>24}" for m in methods)
    header += "".join(f" {m + '/' + first:>18}" for m in methods[1:])
    print(header)
    for path, by_method in summary.items():
        cells = []
        for method in methods:
            point = by_method.get(method)
            cells.append(" " + ("-" if point is None else _cell(point)).rjust(24))
        for method in methods[1:]:
            base, other = by_method.get(first), by_method.get(method)
            ratio = (
                other["median"] / base["median"]
                if base and other and base["median"] > 0
                else math.nan
            )
            cells.append(f" {ratio:18.2f}")
        print(f"  {path:<40}" + "".join(cells))


def _cell(point: dict[str, float]) -> str:
    return f"{point['median']:.4g} ({point['low']:.3g}-{point['high']:.3g})"
