"""``afd bench prefill``: the main job as a benchmark table.

Runs ``afd run``'s job (every mode: async AFD, sync AFD, colocated) for each preset,
workload, A:F layout, SM split and arrival rate, each through the library
(:func:`afd_tools.run.command.run_and_print`) in a fresh process, and gathers one table:
tokens/s, TTFT p50/p99, the goodput under ``--ttft-slo``, the per-layer breakdown and each
mode against sync AFD of the same group, with every output verified. The workloads:

* ``uneven`` -- the heavy-tailed preset mix of ``afd run``;
* ``uniform`` -- the same number of requests and the same total tokens, every prompt about
  the same length;
* ``long`` -- prompts of 8K to 32K tokens, where V3-shaped attention outweighs the FFN (16
  of them; at the quick size 12 of 8K to 16K: a run must fit one call to a lent GPU);
* ``balanced`` -- prompts near the length where a layer's attention and FFN times are
  about equal on one H200 (V3 shapes about 12K tokens, V2-Lite about 24K; from the
  per-layer table of ``docs/design-notes.md``), where AFD can at best tie
  colocated serving on equal GPUs.

The sweeps (each option repeatable): ``--layout A:F``; ``--stages N`` (every mode runs at
the first, async alone at the others, so each async variant meets the sync run of its own
group); ``--attention-share PCT`` (ranks sharing a GPU under CUDA MPS: each attention rank's
share of the SMs, the FFN ranks split the rest; a line under the table names the best split
per A:F); ``--rate R`` (Poisson arrivals per second, for TTFT under load). ``--repeats N``
launches each group's runs N times, one whole group after the other, each run compared
with the sync run of its own repeat; a line under the table gives every ratio's median and
range over the repeats (machines are noisy: one launch's ratio is not a figure). On a GPU an
untimed async run precedes the first timed run of each preset and A:F (``--warm-up``): a
fresh machine otherwise compiles kernels inside the first timed mode.

``--quick`` sizes keep the GPU suite short; the full size is the default. The table is
printed, written as JSON (rewritten after every run, ``"complete": false`` until the last,
so a stopped benchmark keeps what it measured; ``--time-budget`` stops it before a run that
would not fit, and the same command with ``--resume`` continues it:
:mod:`afd_tools.bench.prefill_resume`), and with ``--docs FILE`` replaces the
block between the markers ``<!-- afd bench prefill -->`` and ``<!-- /afd bench prefill
-->`` in that file. Under the
table, a line per placement says where the ranks ran: on one GPU the ranks share it as
clients of a CUDA MPS daemon that each afd run starts and stops, with the shares named, and
the colocated baseline is the monolithic model on the whole GPU. afd run's other options go
through ``--run-arg``, one argument each, written with ``=``: ``--run-arg=--device=cuda
--run-arg=--share-gpus``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from afd_tools.bench.prefill_matrix import (
    FULL,
    QUICK,
    WORKLOADS,
    Sweeps,
    check_sweeps,
    expand,
    job_of,
    parse_layout,
    parse_rate,
    parse_repeats,
    parse_share,
    parse_stages,
    point_job,
    warm_up_plan,
    warms_up,
)
from afd_tools.bench.prefill_resume import (
    NOT_FINISHED_EXIT,
    UNFINISHED_LIMIT,
    Resumed,
    ResumeError,
    point_key,
    resumed_runs,
    unfinished_json,
)
from afd_tools.bench.prefill_table import BenchRun, markdown_table
from afd_tools.outputs import check_writable, write_atomically
from afd_tools.prefill.run_report import RunReport
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.command import run_and_print
from afd_tools.run.job import RunJob

MARKER_BEGIN = "<!-- afd bench prefill -->"
MARKER_END = "<!-- /afd bench prefill -->"
_SPAWN = mp.get_context("spawn")


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "prefill",
        help="afd run's modes as a benchmark: presets x workloads, every output verified",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        action="append",
        default=None,
        help="model shapes, repeatable (default: v2-lite and v3-slice)",
    )
    p.add_argument(
        "--workload",
        action="append",
        choices=WORKLOADS,
        default=None,
        help=f"repeatable (default: all of {', '.join(WORKLOADS)})",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (the GPU suite's)")
    p.add_argument(
        "--layout",
        action="append",
        type=parse_layout,
        default=None,
        metavar="A:F",
        help="attention replicas : FFN ranks, repeatable (default: 1:1)",
    )
    p.add_argument(
        "--stages",
        action="append",
        type=parse_stages,
        default=None,
        metavar="N",
        help="async mode's token-level stages, repeatable: every mode runs at the first, "
        "async alone at the others (default: 2)",
    )
    p.add_argument(
        "--attention-share",
        action="append",
        type=parse_share,
        default=None,
        metavar="PCT",
        help="ranks sharing a GPU: each attention rank's CUDA MPS share of the SMs, the FFN "
        "ranks split the rest; repeatable, a sweep whose best split per A:F is named "
        "(default: afd run's split)",
    )
    p.add_argument(
        "--rate",
        action="append",
        type=parse_rate,
        default=None,
        metavar="R",
        help="Poisson arrivals per second, repeatable (default: every request at once)",
    )
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        metavar="SECONDS",
        help="add a goodput column: requests per second whose TTFT is at most this",
    )
    p.add_argument(
        "--warm-up",
        choices=("auto", "on", "off"),
        default="auto",
        help="an untimed async run before the first timed run of each preset and A:F, so "
        "that what a fresh machine compiles (Triton, cuBLAS) is not timed (auto: on a GPU)",
    )
    p.add_argument(
        "--run-arg",
        action="append",
        default=[],
        help="one more argument for every afd run, written with '=' (repeat: "
        "--run-arg=--device=cuda --run-arg=--share-gpus; the FFN ranks' CUDA MPS share: "
        "--run-arg=--mps-ffn-share=60)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="after this sitting's first run, start no run (with its warm-up) that the "
        "longest run so far says would end past this many seconds from the start; the "
        "JSON then says complete: false, and the same command with --resume continues "
        "(exit status 3 when stopped; needs --json)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs the --json file already holds (the same matrix, else refused) "
        "and run only the others; without the file, start from the first",
    )
    p.add_argument(
        "--repeats",
        type=parse_repeats,
        default=1,
        metavar="N",
        help="launch each group's runs N times, one whole group after the other (A/B/A/B); "
        "a line under the table gives each ratio's median and range over the repeats",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and weights")
    p.add_argument("--json", type=Path, default=None, help="write every run's report here")
    p.add_argument(
        "--plots",
        type=Path,
        default=None,
        metavar="DIR",
        help="write each timed run's timeline (afd run --plot: a row per rank, a bar per "
        "batch or FFN item, a panel per mode) into this directory, created if missing, one "
        "PNG per run named by preset, workload, A:F, share, rate, stages and launch",
    )
    p.add_argument(
        "--docs",
        type=Path,
        default=None,
        help=f"replace the table between {MARKER_BEGIN} and {MARKER_END} in this file",
    )
    p.set_defaults(handler=run_prefill)


def run_in_fresh_process(job: RunJob) -> tuple[int, RunReport | None]:
    """``afd run``'s exit code and report of ``job``, run (and printed) in a fresh process,
    so that nothing of one run -- the verifying process's CUDA context and cached memory,
    its MPS state -- carries into the next. Ctrl-C reaches the child too (one process
    group): it stops its ranks and ends before this returns or raises."""
    reader, writer = _SPAWN.Pipe(duplex=False)
    child = _SPAWN.Process(target=_run_child, args=(job, writer), name="afd-bench-run")
    child.start()
    writer.close()
    answer: tuple[int, RunReport | None] | None = None
    try:
        answer = reader.recv()
    except EOFError:  # the child died before it could answer
        pass
    finally:
        child.join()
        reader.close()
    return answer if answer is not None else (child.exitcode or 1, None)


def _run_child(job: RunJob, results: Connection) -> None:
    """In the fresh process: run ``job`` as ``afd run`` does and send back the outcome."""
    answer = run_and_print(job)
    sys.stdout.flush()
    results.send(answer)
    results.close()


def sweeps_of(args: argparse.Namespace) -> Sweeps:
    """The sweeps of the parsed command line (the one place that reads them)."""

    def given(values: list[Any] | None) -> tuple[Any, ...] | None:
        return None if values is None else tuple(values)

    return Sweeps(
        layouts=given(args.layout),
        stages=given(args.stages),
        attention_shares=given(args.attention_share),
        rates=given(args.rate),
        run_args=tuple(args.run_arg),
        seed=args.seed,
        repeats=args.repeats,
    )


def run_prefill(args: argparse.Namespace) -> int:
    presets = args.preset or ["v2-lite", "v3-slice"]
    workloads = args.workload or list(WORKLOADS)
    size = QUICK if args.quick else FULL
    for path in (args.json, args.docs):
        check_writable(path)
    if args.docs is not None and MARKER_BEGIN not in _read(args.docs):
        print(
            f"afd bench prefill: error: {args.docs} has no {MARKER_BEGIN} ... {MARKER_END} "
            f"block to replace; add the two markers where the table belongs",
            file=sys.stderr,
        )
        return 2
    if args.ttft_slo is not None and not (math.isfinite(args.ttft_slo) and args.ttft_slo > 0):
        print(
            f"afd bench prefill: error: --ttft-slo must be a finite number of seconds > 0, "
            f"got {args.ttft_slo}",
            file=sys.stderr,
        )
        return 2
    if args.plots is not None and args.plots.exists() and not args.plots.is_dir():
        print(
            f"afd bench prefill: error: --plots {args.plots} is a file; give a directory "
            f"(it is created if missing)",
            file=sys.stderr,
        )
        return 2
    if (args.resume or args.time_budget is not None) and args.json is None:
        print(
            "afd bench prefill: error: --resume and --time-budget keep the runs in the "
            "--json file; give one",
            file=sys.stderr,
        )
        return 2
    if args.time_budget is not None and not (
        math.isfinite(args.time_budget) and args.time_budget > 0
    ):
        print(
            f"afd bench prefill: error: --time-budget must be a finite number of seconds "
            f"> 0, got {args.time_budget}",
            file=sys.stderr,
        )
        return 2
    if args.plots is not None:
        try:
            args.plots.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(
                f"afd bench prefill: error: cannot make --plots {args.plots}: {exc}",
                file=sys.stderr,
            )
            return 2
    started = time.perf_counter()
    sweeps = sweeps_of(args)
    results: list[BenchRun] = []
    with tempfile.TemporaryDirectory(prefix="afd-bench-prefill-") as tmp:
        try:
            runs = []
            for preset in presets:
                for workload in workloads:
                    base = point_job(sweeps, preset, workload, size, Path(tmp))
                    check_sweeps(sweeps, base)
                    runs += [(p, job_of(base, p)) for p in expand(sweeps, base, preset, workload)]
        except WorkloadError as exc:
            print(f"afd bench prefill: error: {exc}", file=sys.stderr)
            return 2
        resumed = Resumed()
        if args.resume:
            try:
                resumed = resumed_runs(
                    args.json, runs, size, args.ttft_slo, list(args.run_arg), args.seed
                )
            except ResumeError as exc:
                print(f"afd bench prefill: error: {exc}", file=sys.stderr)
                return 2
            if resumed.kept:
                print(
                    f"resuming {args.json}: {len(resumed.kept)} of {len(runs)} runs already "
                    f"measured"
                )
        kept, warmed, unfinished = resumed.kept, resumed.warm_up, resumed.unfinished
        todo = [i for i in range(len(runs)) if i not in kept]
        warm_ups: dict[int, RunJob] = {}
        if todo and warms_up(args.warm_up, runs[todo[0]][1]):
            # A resumed benchmark may run on a fresh machine: warm up before the first run
            # of each group that is left.
            plan = warm_up_plan([runs[i] for i in todo])
            warm_ups = {todo[j]: job for j, job in plan.items()}

        def save(complete: bool) -> None:
            """The JSON so far (rewritten after every run, so a benchmark that is stopped
            or killed keeps what it measured; ``complete`` says whether every run is in)."""
            if args.json is None:
                return
            data = json.dumps(
                {
                    "size": size.__dict__,
                    "ttft_slo_s": args.ttft_slo,
                    "run_args": list(args.run_arg),
                    "seed": args.seed,
                    "plan": [point_key(point) for point, _ in runs],
                    "complete": complete,
                    "planned_runs": len(runs),
                    "warm_up": warmed,
                    "unfinished": unfinished_json(unfinished, runs),
                    "runs": [r.to_json() for r in results],
                },
                indent=2,
            )
            write_atomically(args.json, lambda tmp: tmp.write_text(data))

        longest = max((r.wall_s for r in kept.values()), default=0.0)
        stopped = False
        ran = 0
        for index, (point, job) in enumerate(runs):
            if index in kept:
                results.append(kept[index])
                continue
            elapsed = time.perf_counter() - started
            # The first run of a sitting always starts, so every sitting makes progress.
            if args.time_budget is not None and ran and elapsed + longest > args.time_budget:
                stopped = True
                break
            if unfinished.get(index, 0) >= UNFINISHED_LIMIT:
                # Started in that many sittings and never finished: longer than a sitting.
                command = job.command_line()
                print(
                    f"[{index + 1}/{len(runs)}] not started again: {unfinished[index]} "
                    f"sittings started it and none saw it finish (longer than a sitting?); "
                    f"recorded as failed (exit {NOT_FINISHED_EXIT}): make it smaller or give "
                    f"it a sitting of its own: {command}",
                    flush=True,
                )
                del unfinished[index]
                results.append(BenchRun(point, command, NOT_FINISHED_EXIT, 0.0, None))
                save(complete=False)
                continue
            ran += 1
            # Marked before it starts: a sitting killed during it leaves the mark behind.
            unfinished[index] = unfinished.get(index, 0) + 1
            save(complete=False)
            if index in warm_ups:
                command, code, wall, _ = _run_announced(warm_ups[index], "warm-up, not timed")
                warmed.append({"command": command, "exit_code": code, "wall_s": wall})
            if args.plots is not None:
                job = dataclasses.replace(job, plot=args.plots / point.plot_name)
            command, code, wall, report = _run_announced(job, f"{index + 1}/{len(runs)}")
            del unfinished[index]
            results.append(BenchRun(point, command, code, wall, report))
            longest = max(longest, wall + (warmed[-1]["wall_s"] if index in warm_ups else 0.0))
            save(complete=False)
        if stopped:
            save(complete=False)
        else:
            save(complete=True)
    failed_warm_ups = [w for w in warmed if w["exit_code"] != 0]
    table = markdown_table(results, args.ttft_slo, args.repeats)
    if failed_warm_ups:
        table += "\n" + "\n".join(
            f"Warm-up failed (exit {w['exit_code']}): {w['command']}" for w in failed_warm_ups
        )
    print(table)
    if args.json is not None:
        print(f"wrote {args.json}")
    if stopped:
        print(
            f"stopped at the time budget ({args.time_budget:g} s): {len(results)} of "
            f"{len(runs)} runs measured, the longest took {longest:.0f} s; the same command "
            f"with --resume continues"
            + ("" if args.docs is None else f" ({args.docs} left as it was)")
        )
        return 3
    if args.docs is not None:
        update_docs(args.docs, table)
        print(f"updated {args.docs}")
    return 1 if any(r.exit_code != 0 for r in results) or failed_warm_ups else 0


def _run_announced(job: RunJob, tag: str) -> tuple[str, int, float, RunReport | None]:
    """Print ``[tag] command``, run ``job`` in a fresh process: (command, exit code, wall
    seconds, report)."""
    command = job.command_line()
    print(f"[{tag}] {command}", flush=True)
    start = time.perf_counter()
    code, report = run_in_fresh_process(job)
    return command, code, time.perf_counter() - start, report


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def update_docs(path: Path, table: str) -> None:
    """Replace the block between the markers in ``path`` with ``table``."""
    text = _read(path)
    head, rest = text.split(MARKER_BEGIN, 1)
    _, tail = rest.split(MARKER_END, 1) if MARKER_END in rest else ("", rest)
    body = f"{MARKER_BEGIN}\n{table}\n{MARKER_END}"
    write_atomically(path, lambda tmp: tmp.write_text(head + body + tail))
