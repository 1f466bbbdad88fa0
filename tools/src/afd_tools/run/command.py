"""``afd run``: launch the system, feed it a workload, verify every output, compare modes.

This module is the command line only: it declares the options (:func:`add_run_options`),
builds the :class:`~afd_tools.run.job.RunJob` from them, runs it through the library
(:mod:`afd_tools.run.plan`, :mod:`afd_tools.run.api`) and prints, writes and plots what it
measured (:func:`run_and_print`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from afd_models import PRESET_NAMES, expert_backend_names
from afd_protocol import AFDError, transport_names
from afd_tools.outputs import json_safe, write_atomically
from afd_tools.prefill.options import add_wire_options, add_workload_options
from afd_tools.prefill.report import print_report, write_plot
from afd_tools.prefill.run_report import RunReport
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.api import execute
from afd_tools.run.devices import COLOCATED
from afd_tools.run.job import MODES, QUANT_TOLERANCE, TOLERANCE, WARM_PASS, RunJob
from afd_tools.run.plan import prepare
from afd_tools.run.verify import QUANT_TIE_MARGIN, TIE_MARGIN, TIE_MARGIN_FROM, TIE_MARGIN_SOURCES

DEFAULT = RunJob()
"""The job of ``afd run`` without options: where the options' defaults come from."""


def job_from_args(args: argparse.Namespace) -> RunJob:
    """The job of ``afd run``'s parsed options (every :class:`RunJob` field from the option
    of its name; ``--mode all`` is every mode): the one place that reads the namespace."""
    values = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(RunJob) if f.name != "modes"
    }
    return RunJob(modes=MODES if args.mode == "all" else (args.mode,), **values)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run attention replicas and FFN ranks as processes on a prefill workload",
        description=(
            "Launch A attention replicas and F FFN ranks as processes (on CPU over shared "
            "memory; on CUDA one GPU per process over NVSHMEM, or with --share-gpus several per "
            "GPU under CUDA MPS), prefill a workload in each mode (async AFD, sync AFD, "
            "colocated), check every request's final hidden state against the monolithic "
            "reference, and report TTFT, throughput and how busy each rank was. Defaults that "
            "depend on the device: float32 / reference experts / shm / colocated dp on CPU; "
            "bfloat16 / grouped_mm / nvshmem / colocated dp-ep on CUDA (mono when the ranks "
            "share one GPU)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_run_options(p)
    p.set_defaults(handler=run)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Every option of ``afd run`` (one per :class:`RunJob` field, ``--mode`` for its
    modes), on ``p``."""
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=DEFAULT.device,
        help="where the ranks compute: cuda (one GPU per process, attention replicas on the "
        "first A GPUs, FFN ranks on the next F) or cpu; auto picks cuda when a GPU is visible",
    )
    p.add_argument(
        "--share-gpus",
        action="store_true",
        help="cuda: allow more processes than GPUs, rank i on GPU i mod G. Ranks sharing a GPU "
        "run as clients of a private CUDA MPS daemon that afd run starts and stops (NVSHMEM "
        "needs it), each with its share of the GPU's SMs. On one GPU this measures fixed "
        "costs, kernels, device waits and asynchrony faithfully, but rows cross HBM, not "
        "NVLink, and each rank has only its share of the SMs",
    )
    p.add_argument(
        "--mps-attention-share",
        type=int,
        default=None,
        metavar="PCT",
        help="with shared GPUs: the percent of its GPU's SMs each attention rank may use "
        "(its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; the FFN ranks on that GPU split the rest; a "
        "GPU's ranks must add up to <= 100; with neither share given, every GPU is split "
        "equally among its ranks)",
    )
    p.add_argument(
        "--mps-ffn-share",
        type=int,
        default=None,
        metavar="PCT",
        help="with shared GPUs: the percent of its GPU's SMs each FFN rank may use (the "
        "attention ranks on that GPU split the rest)",
    )
    p.add_argument(
        "--no-mps",
        action="store_true",
        help="with shared GPUs: start no CUDA MPS daemon; the ranks time-slice the GPU "
        "(--transport shm only: NVSHMEM refuses ranks sharing a GPU outside MPS)",
    )
    p.add_argument("--preset", choices=PRESET_NAMES, default=DEFAULT.preset, help="model shapes")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument(
        "--attention-ranks",
        type=int,
        default=DEFAULT.attention_ranks,
        help="attention DP replicas (A)",
    )
    p.add_argument("--ffn-ranks", type=int, default=DEFAULT.ffn_ranks, help="FFN ranks (F)")
    p.add_argument("--mode", choices=[*MODES, "all"], default="all", help="which modes to run")
    add_workload_options(p)
    p.add_argument(
        "--dtype",
        choices=sorted(TOLERANCE),
        default=None,
        help="activations and weights (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument(
        "--tie-margin",
        type=float,
        default=None,
        help="verification: the relative router-score gap under which a token's top-k is a "
        "near tie, where the reference takes the run's expert choice (default: "
        + ", ".join(f"{v:.1e} in {k}" for k, v in sorted(TIE_MARGIN.items()))
        + f", {QUANT_TIE_MARGIN:.1e} with --cam-dynamic-quant); elsewhere a different choice "
        "is a wrong expert. 1 follows every disagreement: the report's largest followed gap "
        "then measures what a device needs",
    )
    p.add_argument(
        "--tie-margin-from",
        choices=TIE_MARGIN_SOURCES,
        default=TIE_MARGIN_FROM,
        help="verification: what judges a decision the reference followed at a near tie. "
        "depth (default): the margin above, grown in proportion to the layer past layer 8; "
        "drift: at most that, 3x the largest tie-gap drift measured at the probed tokens "
        "(the run's recorded router rows against the reference replay's) at that layer or a "
        "shallower one, at least 2^-8, so it excuses fewer decisions. Both are reported "
        "(JSON: verification_near_ties); docs/testing.md has the measurements",
    )
    p.add_argument(
        "--colocated",
        choices=COLOCATED,
        default=None,
        help="the colocated baseline: dp = each of the A replicas holds the whole model; dp-ep "
        "= one rank per processor AFD uses (A+F on cpu, one per GPU on cuda), each with "
        "attention and its share of the routed experts, tokens exchanged every MoE layer by "
        "all_gather + reduce_scatter (NCCL on cuda, gloo on cpu); mono = the monolithic model "
        "in one process on the whole first GPU (DP1, EP1), all requests first come first "
        "served: what a one-GPU user runs, and what dp-ep becomes on one GPU (default: dp on "
        "cpu, dp-ep on cuda)",
    )
    add_wire_options(p)
    p.add_argument(
        "--transport",
        default=None,
        metavar="{" + ",".join(transport_names()) + "}",
        help="a transport installed here (afd_protocol's transport registry): shm: afd's "
        "shared-memory windows (default on cpu; on cuda rows are staged through host memory); "
        "nvshmem: GPU windows over NVLink (default on cuda); cam-emulator: the CPU emulator of "
        "Ascend CAM's compact routed-only operators (needs --shared attention and experts "
        "that split evenly over the FFN ranks; its own wire format, so --wire-format and "
        "--combine-reduce do not apply)",
    )
    p.add_argument(
        "--cam-dynamic-quant",
        action="store_true",
        help="cam-emulator: dispatch rows as int8 with a per-token scale (outputs are then "
        f"verified to {QUANT_TOLERANCE:g} instead of the dtype's tolerance)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help=f"expert backend on the FFN ranks, one of {', '.join(expert_backend_names())} "
        f"(default: reference on cpu, grouped_mm on cuda)",
    )
    p.add_argument(
        "--ffn-graph-buckets",
        type=_row_counts,
        default=None,
        metavar="ROWS,ROWS,...",
        help="FFN ranks on cuda: run the routed experts as CUDA-graph replays, one graph per "
        "bucket of rows (a larger item runs eagerly); needs --backend triton",
    )
    p.add_argument(
        "--exchange-graphs",
        type=int,
        default=DEFAULT.exchange_graphs,
        metavar="N",
        help="attention ranks on cuda: replay each MoE layer's dispatch and combine from CUDA "
        "graphs, holding up to N token counts (the first use of a count runs eagerly, the "
        "second captures; 0: eager); --transport nvshmem only",
    )
    p.add_argument(
        "--peer-puts",
        action="store_true",
        help="send every slot with NVSHMEM device puts of the bytes it uses (composed in local "
        "staging memory), then the flag, instead of storing rows into peers' mapped memory: "
        "the path for GPUs whose peers cannot be mapped (between nodes); same outputs; "
        "--transport nvshmem only, not with --ffn-graph",
    )
    p.add_argument(
        "--ffn-graph",
        action="store_true",
        help="FFN ranks on cuda: replay the whole serve loop (wait for any ready item on the "
        "device, the experts, the reply) from one CUDA graph, so no host work sits between "
        "an item's arrival and its reply; needs --backend triton, --transport nvshmem and "
        "--shared attention",
    )
    p.add_argument(
        "--warm-pass",
        choices=WARM_PASS,
        default=DEFAULT.warm_pass,
        help="prefill every request once, untimed, in the first mode before the timed modes "
        "(the monolithic baseline's process too), so that no mode runs cold (auto: on cuda, "
        "where a process's first mode ran up to 1.4x slower at makespans under a second; off "
        "on cpu)",
    )
    p.add_argument(
        "--seed", type=int, default=DEFAULT.seed, help="seed for weights and the workload"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT.timeout,
        help="seconds an attention rank waits for FFN replies before failing (a dead peer is "
        "detected within a second whatever this is)",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        default=DEFAULT.run_timeout,
        help="seconds the whole run may take (replicas wait for each other at mode starts "
        "and, in sync mode, at every layer, for up to this long)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG timeline here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _row_counts(text: str) -> tuple[int, ...]:
    """``"1024,8192"`` -> ``(1024, 8192)`` (an ``argparse`` type)."""
    try:
        counts = tuple(int(word) for word in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: comma-separated row counts >= 1, e.g. 1024,8192"
        )
    return counts


def run(args: argparse.Namespace) -> int:
    """``afd run``'s handler: the job of the command line, run and reported."""
    try:
        job = job_from_args(args)
    except WorkloadError as exc:
        return _error(exc)
    code, _ = run_and_print(job)
    return code


def run_and_print(job: RunJob) -> tuple[int, RunReport | None]:
    """Run ``job`` as ``afd run`` does: print the plan, draw the progress (on a terminal,
    unless ``no_progress``), print the comparison, write the JSON report and the plot where
    asked, and say whether every output verified. The exit code (0 passed, 1 an output
    differed, 2 a configuration or run error, 130 interrupted) and the report (``None``
    where the run did not finish)."""
    started = time.perf_counter()
    try:
        plan = prepare(job)
        print(plan.describe())
        with _progress_bar(plan.total, not job.no_progress) as advance:
            result = execute(plan, advance)
        report = result.report
        print_report(report.modes, report.ratios)
        if job.json is not None:
            text = json.dumps(json_safe(report.to_json()), indent=2, allow_nan=False)
            write_atomically(job.json, lambda tmp: tmp.write_text(text))
            print(f"wrote {job.json}")
        if job.plot is not None:
            write_atomically(job.plot, lambda tmp: write_plot(tmp, report.modes, result.outcomes))
            print(f"wrote {job.plot}")
    except (WorkloadError, AFDError) as exc:
        return _error(exc), None
    except KeyboardInterrupt:
        print("afd run: interrupted; every rank process was stopped", file=sys.stderr)
        return 130, None
    elapsed = time.perf_counter() - started
    took = f"{elapsed:.0f} s ({result.phases.describe()})"
    if not result.passed:
        print(f"{result.verdict.fail_line()}; {took}")
        return 1, report
    print(f"{result.verdict.pass_line()}; {took}")
    return 0, report


def _error(exc: Exception) -> int:
    print(f"afd run: error: {exc}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def _progress_bar(total: int, wanted: bool) -> Iterator[Callable[[], None] | None]:
    """A callback that advances a progress bar of ``total`` requests, drawn while the run
    lasts when ``wanted`` and on a terminal; else ``None``."""
    if not wanted or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("prefill requests (all modes)", total=total)
        yield lambda: bar.advance(task)


__all__ = [
    "COLOCATED",
    "MODES",
    "AFDError",
    "add_parser",
    "add_run_options",
    "run",
    "run_and_print",
]
