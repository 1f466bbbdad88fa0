"""The runs of ``afd bench prefill``: presets x workloads x A:F layouts x SM splits x
arrival rates, and the async stage counts within each.

Every (preset, workload, layout, split, rate) is one :class:`Point` group: a run of every
mode (async at the first ``--stages``, sync, colocated), then one async-only run per further
``--stages``, so every async variant is compared with the sync and colocated runs of its own
group. The sizes are :data:`QUICK` (the GPU suite's) and :data:`FULL`.

A :class:`~afd_tools.run.job.RunJob` is built per run from this benchmark's settings with
``--run-arg`` options over them: a ``--run-arg`` wins over a default of the benchmark, and
setting with ``--run-arg`` what the benchmark sweeps (``--layout``, ``--stages``,
``--attention-share``, ``--rate``) is refused, so the table never labels a run with values
it did not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd_tools.prefill.workload import WorkloadError, prompt_lengths
from afd_tools.run.command import add_run_options, job_from_args
from afd_tools.run.job import MODES, RunJob, option

WORKLOADS = ("uneven", "uniform", "long", "balanced")
BALANCED_LENGTH = {"v3-slice": 12288, "v2-lite": 24576, "v3-mini": 4096, "tiny": 128}
"""Prompt length per preset at which one layer's attention time is about its FFN time."""


@dataclass(frozen=True)
class Size:
    requests: int
    max_prompt_len: int
    budget: int
    """``--max-num-batched-tokens``."""
    layers: dict[str, int]
    long_range: tuple[int, int]
    long_requests: int
    """Requests of the ``long`` mix: each is 8K-32K tokens, so fewer than the others have
    (at 48 of them, 985K tokens, one full-size v3-slice 2A1F run on one H200 took over
    9 minutes, more than one call to a lent GPU machine)."""


QUICK = Size(12, 4096, 8192, {"v2-lite": 4, "v3-slice": 2}, (8192, 16384), 12)
FULL = Size(48, 16384, 16384, {"v2-lite": 27, "v3-slice": 4}, (8192, 32768), 16)

SWEPT = {
    "attention_ranks": "--layout",
    "ffn_ranks": "--layout",
    "stages": "--stages",
    "mps_attention_share": "--attention-share",
    "rate": "--rate",
}
"""The job fields this benchmark sweeps, and its option that sets each."""
OWNED = {
    "preset": "--preset",
    "workload": "--workload",
    "workload_file": "--workload",
    "requests": "the size (--quick or not)",
    "max_prompt_len": "the size (--quick or not)",
    "seed": "--seed",
}
"""The job fields this benchmark sets for every run and labels its rows with (or builds its
workload files from): a ``--run-arg`` may not set them, whatever the sweeps; the option of
the benchmark to use instead."""


def parse_layout(text: str) -> tuple[int, int]:
    """``"A:F"`` -> ``(A, F)``; an ``argparse`` type (its error names the option)."""
    parts = text.split(":")
    try:
        a, f = (int(p) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        a = f = 0
    if a < 1 or f < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not A:F (attention replicas : FFN ranks, each >= 1), e.g. 2:1"
        )
    return a, f


def _at_least_one(text: str, what: str) -> int:
    """``text`` as a whole number >= 1; ``argparse.ArgumentTypeError`` saying ``what``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: {what}, a whole number >= 1")
    return value


def parse_repeats(text: str) -> int:
    """A repeat count (a whole number >= 1)."""
    return _at_least_one(text, "launches per run")


def parse_rate(text: str) -> float:
    """A Poisson arrival rate in requests per second (> 0, finite)."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a rate is requests per second, > 0")
    return rate


def parse_stages(text: str) -> int:
    """A stage count (a whole number >= 1)."""
    return _at_least_one(text, "stages")


def parse_share(text: str) -> int:
    """A CUDA MPS share in percent of a GPU's SMs (1..99: the FFN ranks need the rest)."""
    try:
        share = int(text)
    except ValueError:
        share = 0
    if not 1 <= share <= 99:
        raise argparse.ArgumentTypeError(
            f"{text!r}: an attention rank's share is a whole percent from 1 to 99"
        )
    return share


@dataclass(frozen=True)
class Point:
    """One run of the benchmark; :attr:`group` is what the runs it is compared with share."""

    preset: str
    workload: str
    attention_ranks: int
    ffn_ranks: int
    attention_share: int | None
    """Each attention rank's MPS share (``None``: ``afd run``'s split)."""
    rate: float | None
    """Poisson arrivals per second (``None``: every request at once)."""
    stages: int
    """Async mode's stages."""
    modes: tuple[str, ...]
    repeat: int = 0
    """Which of ``--repeats`` launches of this configuration (0 for the first)."""

    @property
    def group(self) -> tuple[str, str, int, int, int | None, float | None]:
        return (
            self.preset,
            self.workload,
            self.attention_ranks,
            self.ffn_ranks,
            self.attention_share,
            self.rate,
        )

    @property
    def layout(self) -> str:
        return f"{self.attention_ranks}A{self.ffn_ranks}F"

    @property
    def plot_name(self) -> str:
        """The file name of this run's timeline under ``--plots`` (one per run of a
        matrix): preset, workload, A:F, share, rate, stages and launch, e.g.
        ``v3-slice-long-2A1F-a25-rate2-n2-run1.png``."""
        parts = [self.preset, self.workload, self.layout]
        if self.attention_share is not None:
            parts.append(f"a{self.attention_share}")
        if self.rate is not None:
            parts.append(f"rate{self.rate:g}")
        parts += [f"n{self.stages}", f"run{self.repeat + 1}"]
        return "-".join(parts) + ".png"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "modes": list(self.modes)}


@dataclass(frozen=True)
class Sweeps:
    """What the benchmark varies, as given on its command line (``None``: not given, so the
    benchmark's default or a ``--run-arg``'s value), and the rest it passes on."""

    layouts: tuple[tuple[int, int], ...] | None = None
    """``--layout``: (A, F) each."""
    stages: tuple[int, ...] | None = None
    attention_shares: tuple[int, ...] | None = None
    rates: tuple[float, ...] | None = None
    run_args: tuple[str, ...] = ()
    """``--run-arg``: ``afd run`` options over the benchmark's settings."""
    seed: int = 0
    repeats: int = 1
    """``--repeats``: launches of each group's runs, one whole group after the other."""


def workload_lengths(workload: str, preset: str, size: Size, seed: int) -> list[int] | None:
    """Prompt lengths for a workload file, or None for ``uneven`` (afd run's own preset)."""
    rng = random.Random(seed)
    n = size.requests
    if workload == "uneven":
        return None
    if workload == "uniform":
        total = sum(prompt_lengths("uneven", n, seed, size.max_prompt_len))
        base, extra = divmod(total, n)
        return [base + (i < extra) for i in range(n)]
    if workload == "long":
        low, high = size.long_range
        return [rng.randint(low, high) for _ in range(size.long_requests)]
    center = BALANCED_LENGTH.get(preset, size.max_prompt_len)
    return [int(center * rng.uniform(0.9, 1.1)) for _ in range(n)]


def _parse_run_args(run_args: tuple[str, ...], defaults: dict[str, Any]) -> argparse.Namespace:
    """``run_args`` parsed as ``afd run``'s options over ``defaults``."""
    parser = argparse.ArgumentParser(prog="afd bench prefill --run-arg", add_help=False)
    add_run_options(parser)
    parser.set_defaults(**defaults)
    return parser.parse_args(list(run_args))


def _job(defaults: dict[str, Any], run_args: tuple[str, ...]) -> RunJob:
    return job_from_args(_parse_run_args(run_args, defaults))


def point_job(sweeps: Sweeps, preset: str, workload: str, size: Size, folder: Path) -> RunJob:
    """The ``afd run`` job of one (preset, workload) at the benchmark's first layout and
    stage count: this benchmark's settings, then the ``--run-arg`` options over them (a
    ``--run-arg`` wins). A workload other than ``uneven`` is written as a JSONL file into
    ``folder``."""
    attention, ffn = sweeps.layouts[0] if sweeps.layouts else (1, 1)
    defaults: dict[str, Any] = {
        "preset": preset,
        "attention_ranks": attention,
        "ffn_ranks": ffn,
        "stages": sweeps.stages[0] if sweeps.stages else 2,
        "max_num_batched_tokens": size.budget,
        "seed": sweeps.seed,
        "no_progress": True,
    }
    if preset in size.layers:
        defaults["layers"] = size.layers[preset]
    lengths = workload_lengths(workload, preset, size, sweeps.seed)
    if lengths is None:
        defaults |= {
            "workload": "uneven",
            "requests": size.requests,
            "max_prompt_len": size.max_prompt_len,
        }
    else:
        path = folder / f"{preset}-{workload}.jsonl"
        path.write_text("".join(json.dumps({"prompt_len": n}) + "\n" for n in lengths))
        defaults["workload_file"] = path
    return _job(defaults, sweeps.run_args)


def check_sweeps(sweeps: Sweeps, base: RunJob) -> None:
    """Refuse a ``--run-arg`` that sets what a given sweep option varies (or ``--mode``
    with several ``--stages``), naming both, and ``--attention-share`` where no GPU is
    shared."""
    if sweeps.attention_shares is not None and not base.share_gpus:
        missing = " ".join(
            f"--run-arg={arg}"
            for arg, needed in (("--device=cuda", base.device != "cuda"), ("--share-gpus", True))
            if needed
        )
        raise WorkloadError(
            f"--attention-share sets CUDA MPS shares of ranks sharing a GPU: add {missing}"
        )
    given = {
        "--layout": sweeps.layouts is not None,
        "--stages": sweeps.stages is not None,
        "--attention-share": sweeps.attention_shares is not None,
        "--rate": sweeps.rates is not None,
    }
    set_here = run_arg_fields(sweeps.run_args)
    for name, instead in OWNED.items():
        if name in set_here:
            raise WorkloadError(
                f"--run-arg={option(name)}: the benchmark sets it for every run (and labels "
                f"its rows with it); use {instead}"
            )
    for name, flag in SWEPT.items():
        if given[flag] and name in set_here:
            raise WorkloadError(
                f"{flag} sweeps what --run-arg={option(name)} sets: give it one way"
            )
    if sweeps.stages is not None and len(sweeps.stages) > 1 and "mode" in set_here:
        raise WorkloadError(
            "several --stages run every mode at the first and async alone at the others: "
            "drop --run-arg=--mode"
        )


def run_arg_fields(run_args: tuple[str, ...]) -> set[str]:
    """The ``afd run`` options (by field name) that ``run_args`` set, whatever the value."""
    unset = object()
    names = [*SWEPT, *OWNED, "mode"]
    parsed = vars(_parse_run_args(run_args, dict.fromkeys(names, unset)))
    return {name for name in names if parsed[name] is not unset}


def expand(sweeps: Sweeps, base: RunJob, preset: str, workload: str) -> list[Point]:
    """Every run of one (preset, workload), in the order they run: per layout, split and
    rate, every mode at the first stage count, then async at each further one; with
    ``repeats``, that sequence again and again (A/B/A/B, so drift over time hits every
    variant alike)."""
    layouts = sweeps.layouts or ((base.attention_ranks, base.ffn_ranks),)
    shares = sweeps.attention_shares or (base.mps_attention_share,)
    rates = sweeps.rates or (base.rate,)
    stages = sweeps.stages or (base.stages,)
    points = []
    for attention, ffn in dict.fromkeys(layouts):
        for share in dict.fromkeys(shares):
            for rate in dict.fromkeys(rates):
                for repeat in range(sweeps.repeats):
                    for i, n in enumerate(dict.fromkeys(stages)):
                        modes = base.modes if i == 0 else ("async",)
                        points.append(
                            Point(preset, workload, attention, ffn, share, rate, n, modes, repeat)
                        )
    return points


def job_of(base: RunJob, point: Point) -> RunJob:
    """``base`` at ``point``'s layout, split, rate, stages and modes."""
    return dataclasses.replace(
        base,
        attention_ranks=point.attention_ranks,
        ffn_ranks=point.ffn_ranks,
        mps_attention_share=point.attention_share,
        rate=point.rate,
        stages=point.stages,
        modes=point.modes,
    )


def warm_up_plan(runs: list[tuple[Point, RunJob]]) -> dict[int, RunJob]:
    """Before the first timed run of each (preset, A:F), an untimed run of its job in async
    mode alone (index of that timed run -> the warm-up job). It compiles and caches on disk
    what a first launch on a fresh machine compiles inside its first timed mode (measured on
    one H200: 13-26 ms per layer in async dispatch against 0.2-1.4 ms in later launches)."""
    plan: dict[int, RunJob] = {}
    seen: set[tuple[str, int, int]] = set()
    for index, (point, job) in enumerate(runs):
        key = (point.preset, point.attention_ranks, point.ffn_ranks)
        if key not in seen:
            seen.add(key)
            plan[index] = dataclasses.replace(job, modes=("async",), json=None, plot=None)
    return plan


def warms_up(mode: str, base: RunJob) -> bool:
    """``--warm-up``: ``on``, ``off``, or ``auto`` (on where the runs use a CUDA GPU)."""
    if mode != "auto":
        return mode == "on"
    import torch

    return base.device == "cuda" or (base.device == "auto" and torch.cuda.is_available())


__all__ = [
    "FULL",
    "MODES",
    "QUICK",
    "WORKLOADS",
    "Point",
    "Size",
    "Sweeps",
    "check_sweeps",
    "expand",
    "job_of",
    "parse_layout",
    "parse_rate",
    "parse_repeats",
    "parse_share",
    "parse_stages",
    "point_job",
    "warm_up_plan",
    "warms_up",
    "workload_lengths",
]
