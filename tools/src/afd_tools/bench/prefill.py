"""``afd bench prefill``: the main job as a benchmark table.

Runs ``afd run``'s job (every mode: async AFD, sync AFD, colocated) for each preset and
workload, each through the library (:func:`afd_tools.run.command.run_and_print`) in a fresh
process, and gathers one table: tokens/s, TTFT p50/p99, the per-layer breakdown and the
ratios async/sync and async/colocated, with every output verified. The workloads:

* ``uneven`` -- the heavy-tailed preset mix of ``afd run``;
* ``uniform`` -- the same number of requests and the same total tokens, every prompt about
  the same length;
* ``long`` -- prompts of 8K to 32K tokens, where V3-shaped attention outweighs the FFN;
* ``balanced`` -- prompts near the length where a layer's attention and FFN times are
  about equal on one H200 (V3 shapes about 12K tokens, V2-Lite about 24K; from the
  per-layer table of ``docs/design-notes.md``), where AFD can at best tie
  colocated serving on equal GPUs.

``--quick`` sizes keep the GPU suite short; the full size is the default. The table is
printed, written as JSON, and with ``--docs FILE`` replaces the block between the markers
``<!-- afd bench prefill -->`` and ``<!-- /afd bench prefill -->`` in that file. Under the
table, a line per placement says where the ranks ran: on one GPU the ranks share it as
clients of a CUDA MPS daemon that each afd run starts and stops, with the shares named, and
the colocated baseline is the monolithic model on the whole GPU. afd run's options go
through ``--run-arg``, one argument each, written with ``=``: ``--run-arg=--share-gpus
--run-arg=--mps-ffn-share=60``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from afd_tools.outputs import check_writable, json_safe, write_atomically
from afd_tools.prefill.run_report import RunReport
from afd_tools.prefill.workload import WorkloadError, prompt_lengths
from afd_tools.run.command import add_run_options, job_from_args, run_and_print
from afd_tools.run.job import RunJob

WORKLOADS = ("uneven", "uniform", "long", "balanced")
BALANCED_LENGTH = {"v3-slice": 12288, "v2-lite": 24576, "v3-mini": 4096, "tiny": 128}
"""Prompt length per preset at which one layer's attention time is about its FFN time."""
MARKER_BEGIN = "<!-- afd bench prefill -->"
MARKER_END = "<!-- /afd bench prefill -->"
_SPAWN = mp.get_context("spawn")


@dataclass(frozen=True)
class Size:
    requests: int
    max_prompt_len: int
    budget: int
    """``--max-num-batched-tokens``."""
    layers: dict[str, int]
    long_range: tuple[int, int]


QUICK = Size(12, 4096, 8192, {"v2-lite": 4, "v3-slice": 2}, (8192, 16384))
FULL = Size(48, 16384, 16384, {"v2-lite": 27, "v3-slice": 4}, (8192, 32768))


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
    p.add_argument("--attention-ranks", type=int, default=1, help="A")
    p.add_argument("--ffn-ranks", type=int, default=1, help="F")
    p.add_argument("--stages", type=int, default=2, help="async mode's token-level stages")
    p.add_argument(
        "--run-arg",
        action="append",
        default=[],
        help="one more argument for every afd run, written with '=' (repeat: "
        "--run-arg=--device --run-arg=cpu; one GPU: --run-arg=--share-gpus, and to choose "
        "the CUDA MPS shares --run-arg=--mps-ffn-share=60 or --run-arg=--mps-attention-share=40)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and weights")
    p.add_argument("--json", type=Path, default=None, help="write every run's report here")
    p.add_argument(
        "--docs",
        type=Path,
        default=None,
        help=f"replace the table between {MARKER_BEGIN} and {MARKER_END} in this file",
    )
    p.set_defaults(handler=run_prefill)


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
        return [rng.randint(low, high) for _ in range(n)]
    center = BALANCED_LENGTH.get(preset, size.max_prompt_len)
    return [int(center * rng.uniform(0.9, 1.1)) for _ in range(n)]


def point_job(
    args: argparse.Namespace, preset: str, workload: str, size: Size, folder: Path
) -> RunJob:
    """The ``afd run`` job of one (preset, workload): this benchmark's settings, then the
    ``--run-arg`` options over them (a ``--run-arg`` wins). A workload other than
    ``uneven`` is written as a JSONL file into ``folder``."""
    defaults: dict[str, Any] = {
        "preset": preset,
        "attention_ranks": args.attention_ranks,
        "ffn_ranks": args.ffn_ranks,
        "stages": args.stages,
        "max_num_batched_tokens": size.budget,
        "seed": args.seed,
        "no_progress": True,
    }
    if preset in size.layers:
        defaults["layers"] = size.layers[preset]
    lengths = workload_lengths(workload, preset, size, args.seed)
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
    parser = argparse.ArgumentParser(prog="afd bench prefill --run-arg", add_help=False)
    add_run_options(parser)
    parser.set_defaults(**defaults)
    return job_from_args(parser.parse_args(args.run_arg))


@dataclass(frozen=True)
class BenchRun:
    """One (preset, workload) of the benchmark: its job, how it ended, and its report."""

    preset: str
    workload: str
    command: str
    """The equivalent ``afd run`` command line."""
    exit_code: int
    wall_s: float
    report: RunReport | None
    """``None`` where the run did not finish (a configuration error, a crash)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "preset": self.preset,
            "workload": self.workload,
            "command": self.command,
            "exit_code": self.exit_code,
            "wall_s": self.wall_s,
        }
        if self.report is not None:
            out["report"] = json_safe(self.report.to_json())
        return out


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
    results: list[BenchRun] = []
    with tempfile.TemporaryDirectory(prefix="afd-bench-prefill-") as tmp:
        points = [(p, w) for p in presets for w in workloads]
        try:
            jobs = [point_job(args, p, w, size, Path(tmp)) for p, w in points]
        except WorkloadError as exc:
            print(f"afd bench prefill: error: {exc}", file=sys.stderr)
            return 2
        for index, ((preset, workload), job) in enumerate(zip(points, jobs, strict=True), 1):
            command = job.command_line()
            print(f"[{index}/{len(points)}] {command}", flush=True)
            start = time.perf_counter()
            code, report = run_in_fresh_process(job)
            wall = time.perf_counter() - start
            results.append(BenchRun(preset, workload, command, code, wall, report))
    table = markdown_table(results)
    print(table)
    if args.json is not None:
        runs = [r.to_json() for r in results]
        data = json.dumps({"size": size.__dict__, "runs": runs}, indent=2)
        write_atomically(args.json, lambda tmp: tmp.write_text(data))
        print(f"wrote {args.json}")
    if args.docs is not None:
        update_docs(args.docs, table)
        print(f"updated {args.docs}")
    return 1 if any(r.exit_code != 0 for r in results) else 0


def markdown_table(results: Sequence[BenchRun]) -> str:
    """One row per (preset, workload, mode); a failed or unverified run says so."""
    lines = [
        "| preset | workload | mode | tokens/s | TTFT p50 s | TTFT p99 s | per layer: compute / "
        "dispatch / combine ms | FFN ms per item | async / this | verified (worst error) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in results:
        report = entry.report
        if report is None:
            lines.append(
                f"| {entry.preset} | {entry.workload} | - | failed (exit "
                f"{entry.exit_code}) | | | | | | no |"
            )
            continue
        modes = report.modes
        for mode, m in modes.items():
            b = m.breakdown
            split = " / ".join(
                "-" if v is None else f"{v:.2f}"
                for v in (b.compute_ms_per_layer, b.dispatch_ms_per_layer, b.combine_ms_per_layer)
            )
            item = "-" if b.ffn_ms_per_item is None else f"{b.ffn_ms_per_item:.2f}"
            ratio = "-"
            if mode != "async" and "async" in modes:
                ratio = f"{modes['async'].tokens_per_s / m.tokens_per_s:.2f}x"
            verdict = _verified(report, mode)
            lines.append(
                f"| {entry.preset} | {entry.workload} | {mode} | {m.tokens_per_s:.0f} | "
                f"{m.ttft_p50:.3f} | {m.ttft_p99:.3f} | {split} | {item} | {ratio} | "
                f"{verdict} |"
            )
    notes = placement_notes(results)
    return "\n".join([*lines, *([""] if notes else []), *notes])


def placement_notes(results: Sequence[BenchRun]) -> list[str]:
    """One line per distinct placement of the runs: the device, how the ranks shared GPUs
    (under CUDA MPS, with each rank's share) and the colocated baseline."""
    notes: list[str] = []
    for entry in results:
        placement = entry.report.placement if entry.report is not None else {}
        if "colocated_label" not in placement:
            continue
        sharing = placement.get("sharing", "none")
        where = placement["kind"] + ("" if sharing == "none" else f" ({sharing})")
        note = f"Placement: {where}; {placement['colocated_label']}."
        if note not in notes:
            notes.append(note)
    return notes


def _verified(report: RunReport, mode: str) -> str:
    """The table's verdict for one mode: yes or no, the worst error, near ties followed.

    A worst error that is missing (``None``: not finite) or not a finite number is a
    failure whatever the failures list says."""
    verification = report.verification
    worst = verification.get("verification_worst", {}).get(mode, {})
    error = worst.get("relative_error")
    finite = isinstance(error, int | float) and math.isfinite(error)
    failed = mode in verification.get("verification_failures", {}) or (bool(worst) and not finite)
    verdict = "no" if failed else "yes"
    if finite:
        verdict += f" ({error:.1e})"
    elif worst:
        verdict += " (not finite)"
    followed = verification.get("verification_near_ties", {}).get(mode, {}).get("followed", 0)
    if followed:
        verdict += f", {followed} near ties followed"
    return verdict


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def update_docs(path: Path, table: str) -> None:
    """Replace the block between the markers in ``path`` with ``table``."""
    text = _read(path)
    head, rest = text.split(MARKER_BEGIN, 1)
    _, tail = rest.split(MARKER_END, 1) if MARKER_END in rest else ("", rest)
    body = f"{MARKER_BEGIN}\n{table}\n{MARKER_END}"
    write_atomically(path, lambda tmp: tmp.write_text(head + body + tail))
