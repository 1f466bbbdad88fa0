"""``afd bench prefill``: the main job as a benchmark table.

Runs ``afd run`` (every mode: async AFD, sync AFD, colocated) for each preset and workload,
each run in a fresh process, and gathers one table: tokens/s, TTFT p50/p99, the per-layer
breakdown and the ratios async/sync and async/colocated, with every output verified. The
workloads:

* ``uneven`` -- the heavy-tailed preset mix of ``afd run``;
* ``uniform`` -- the same number of requests and the same total tokens, every prompt about
  the same length;
* ``long`` -- prompts of 8K to 32K tokens, where V3-shaped attention outweighs the FFN;
* ``balanced`` -- prompts near the length where a layer's attention and FFN times are
  about equal on one H200 (V3 shapes about 12K tokens, V2-Lite about 24K; from the
  per-layer table of ``../shared/design/ARCHITECTURE.md``), where AFD can at best tie
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
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd_tools.outputs import check_writable, write_atomically

WORKLOADS = ("uneven", "uniform", "long", "balanced")
BALANCED_LENGTH = {"v3-slice": 12288, "v2-lite": 24576, "v3-mini": 4096, "tiny": 128}
"""Prompt length per preset at which one layer's attention time is about its FFN time."""
MARKER_BEGIN = "<!-- afd bench prefill -->"
MARKER_END = "<!-- /afd bench prefill -->"


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
        from afd_tools.prefill.workload import prompt_lengths

        total = sum(prompt_lengths("uneven", n, seed, size.max_prompt_len))
        base, extra = divmod(total, n)
        return [base + (i < extra) for i in range(n)]
    if workload == "long":
        low, high = size.long_range
        return [rng.randint(low, high) for _ in range(n)]
    center = BALANCED_LENGTH.get(preset, size.max_prompt_len)
    return [int(center * rng.uniform(0.9, 1.1)) for _ in range(n)]


def run_args(
    args: argparse.Namespace, preset: str, workload: str, size: Size, folder: Path
) -> list[str]:
    """The ``afd run`` command line of one (preset, workload)."""
    argv = [
        "run",
        "--preset",
        preset,
        "--attention-ranks",
        str(args.attention_ranks),
        "--ffn-ranks",
        str(args.ffn_ranks),
        "--stages",
        str(args.stages),
        "--max-num-batched-tokens",
        str(size.budget),
        "--seed",
        str(args.seed),
        "--no-progress",
    ]
    if preset in size.layers:
        argv += ["--layers", str(size.layers[preset])]
    lengths = workload_lengths(workload, preset, size, args.seed)
    if lengths is None:
        argv += [
            "--workload",
            "uneven",
            "--requests",
            str(size.requests),
            "--max-prompt-len",
            str(size.max_prompt_len),
        ]
    else:
        path = folder / f"{preset}-{workload}.jsonl"
        path.write_text("".join(json.dumps({"prompt_len": n}) + "\n" for n in lengths))
        argv += ["--workload-file", str(path)]
    return [*argv, *args.run_arg]


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
    results: list[dict[str, Any]] = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="afd-bench-prefill-") as tmp:
        folder = Path(tmp)
        points = [(p, w) for p in presets for w in workloads]
        for index, (preset, workload) in enumerate(points, 1):
            report = folder / f"{preset}-{workload}.json"
            argv = [*run_args(args, preset, workload, size, folder), "--json", str(report)]
            print(f"[{index}/{len(points)}] afd {' '.join(argv)}", flush=True)
            start = time.perf_counter()
            child = subprocess.run([sys.executable, "-m", "afd_tools.cli", *argv], check=False)
            entry: dict[str, Any] = {
                "preset": preset,
                "workload": workload,
                "command": "afd " + " ".join(argv[:-2]),
                "exit_code": child.returncode,
                "wall_s": time.perf_counter() - start,
            }
            if report.exists():
                entry["report"] = json.loads(report.read_text())
            failed += child.returncode != 0
            results.append(entry)
    table = markdown_table(results)
    print(table)
    if args.json is not None:
        data = json.dumps({"size": size.__dict__, "runs": results}, indent=2)
        write_atomically(args.json, lambda tmp: tmp.write_text(data))
        print(f"wrote {args.json}")
    if args.docs is not None:
        update_docs(args.docs, table)
        print(f"updated {args.docs}")
    return 1 if failed else 0


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per (preset, workload, mode); a failed or unverified run says so."""
    lines = [
        "| preset | workload | mode | tokens/s | TTFT p50 s | TTFT p99 s | per layer: compute / "
        "dispatch / combine ms | FFN ms per item | async / this | verified (worst error) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in results:
        report = entry.get("report")
        if report is None:
            lines.append(
                f"| {entry['preset']} | {entry['workload']} | - | failed (exit "
                f"{entry['exit_code']}) | | | | | | no |"
            )
            continue
        modes = report["modes"]
        for mode, m in modes.items():
            b = m.get("breakdown", {})
            split = " / ".join(
                f"{b[k]:.2f}" if k in b else "-"
                for k in ("compute_ms_per_layer", "dispatch_ms_per_layer", "combine_ms_per_layer")
            )
            item = f"{b['ffn_ms_per_item']:.2f}" if "ffn_ms_per_item" in b else "-"
            ratio = "-"
            if mode != "async" and "async" in modes:
                ratio = f"{modes['async']['tokens_per_s'] / m['tokens_per_s']:.2f}x"
            verdict = _verified(report, mode)
            lines.append(
                f"| {entry['preset']} | {entry['workload']} | {mode} | {m['tokens_per_s']:.0f} | "
                f"{m['ttft_p50']:.3f} | {m['ttft_p99']:.3f} | {split} | {item} | {ratio} | "
                f"{verdict} |"
            )
    notes = placement_notes(results)
    return "\n".join([*lines, *([""] if notes else []), *notes])


def placement_notes(results: list[dict[str, Any]]) -> list[str]:
    """One line per distinct placement of the runs: the device, how the ranks shared GPUs
    (under CUDA MPS, with each rank's share) and the colocated baseline."""
    notes: list[str] = []
    for entry in results:
        placement = (entry.get("report") or {}).get("placement", {})
        if "colocated_label" not in placement:
            continue
        sharing = placement.get("sharing", "none")
        where = placement["kind"] + ("" if sharing == "none" else f" ({sharing})")
        note = f"Placement: {where}; {placement['colocated_label']}."
        if note not in notes:
            notes.append(note)
    return notes


def _verified(report: dict[str, Any], mode: str) -> str:
    """The table's verdict for one mode: yes or no, the worst error, near ties followed.

    A worst error that is missing (``null``: not finite) or not a finite number (a report
    of an older afd, which wrote NaN) is a failure whatever the failures list says."""
    worst = report.get("verification_worst", {}).get(mode, {})
    error = worst.get("relative_error")
    finite = isinstance(error, int | float) and math.isfinite(error)
    failed = mode in report["verification_failures"] or (bool(worst) and not finite)
    verdict = "no" if failed else "yes"
    if finite:
        verdict += f" ({error:.1e})"
    elif worst:
        verdict += " (not finite)"
    followed = report.get("verification_near_ties", {}).get(mode, {}).get("followed", 0)
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
