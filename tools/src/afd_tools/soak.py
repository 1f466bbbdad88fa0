"""``afd soak``: a long ``afd run`` whose rank processes are watched for leaks.

Runs ``afd run``'s job (every mode, Poisson arrivals, an uneven mix with prompts longer
than the batch budget, so they are prefilled in chunks) through the library
(:func:`afd_tools.run.command.run_and_print`), and samples every rank process's resident
memory and open file descriptors from ``/proc`` while it runs. The ranks are processes of
their own (this process's descendants), so watching them needs no further process: a helper
thread samples them while the main thread runs the job. It passes when the run verified
every output and no rank's file descriptors or memory grew over the run: the median of the
last quarter of the samples against the median of the second quarter (the first is
start-up), within a tolerance for allocator noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_tools.run.command import run_and_print
from afd_tools.run.job import RunJob

PAGE = os.sysconf("SC_PAGE_SIZE")
RSS_SLACK_BYTES = 32 << 20
"""Growth tolerated in any case (allocator arenas settling, a new mode's first buffers)."""
RSS_SLACK_FRACTION = 0.10


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "soak",
        help="a long afd run on CPU, every rank's memory and file descriptors watched",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--requests", type=int, default=1000, help="requests (every mode serves all of them)"
    )
    p.add_argument("--rate", type=float, default=25.0, help="Poisson arrivals, requests/s")
    p.add_argument("--max-prompt-len", type=int, default=256, help="longest prompt")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=64,
        help="step budget (smaller than the longest prompt, so long prompts are chunked)",
    )
    p.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    p.add_argument("--json", type=Path, default=None, help="write every sample here")
    p.set_defaults(handler=run)


@dataclass
class RankSamples:
    name: str
    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def verdict(self) -> tuple[bool, str]:
        """Whether this rank did not grow, and the numbers that say so."""
        n = len(self.rss)
        if n < 8:
            return False, f"only {n} samples: run longer or sample more often"
        early = slice(n // 4, n // 2)
        late = slice(3 * n // 4, n)
        rss_early = statistics.median(self.rss[early])
        rss_late = statistics.median(self.rss[late])
        allowed = max(RSS_SLACK_BYTES, RSS_SLACK_FRACTION * rss_early)
        # The fewest open at any sample: a rank opens files for a moment (its liveness checks
        # read /proc), but a leak raises the floor.
        fds_early, fds_late = min(self.fds[early]), min(self.fds[late])
        ok = rss_late - rss_early <= allowed and fds_late <= fds_early
        text = (
            f"RSS {rss_early / 2**20:7.1f} -> {rss_late / 2**20:7.1f} MiB "
            f"(allowed +{allowed / 2**20:.0f}), open fds {fds_early} -> {fds_late}"
        )
        return ok, text


def _descendant_ranks(root: int) -> dict[int, str]:
    """afd rank processes descending from ``root``: pid -> name (afd-attn0, afd-ffn1, ...).
    The ranks are children of the launch's fork server, itself a child of ``root``."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        pid = int(entry.name)
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[pid] = int(fields[1])
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if comm.startswith("afd-") and fields[0] != "Z":
            names[pid] = comm
    found = {}
    for pid, name in names.items():
        ancestor, seen = parents.get(pid, 0), 0
        while ancestor > 1 and ancestor != root and seen < 64:
            ancestor, seen = parents.get(ancestor, 0), seen + 1
        if ancestor == root:
            found[pid] = name
    return found


def _sample(pid: int) -> tuple[int, int] | None:
    try:
        resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return resident, fds


class Sampler:
    """A helper thread that samples every rank process of this one (its descendants named
    ``afd-*``) every ``interval`` seconds while the run goes on in the main thread
    (which must launch it: Ctrl-C and SIGTERM stop the ranks from there)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.ranks: dict[int, RankSamples] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_all, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample_all(self) -> None:
        parent = os.getpid()
        while not self._stop.is_set():
            for pid, name in _descendant_ranks(parent).items():
                sample = _sample(pid)
                if sample is not None:
                    entry = self.ranks.setdefault(pid, RankSamples(name))
                    entry.rss.append(sample[0])
                    entry.fds.append(sample[1])
            self._stop.wait(self.interval)


def run(args: argparse.Namespace) -> int:
    job = RunJob(
        device="cpu",
        requests=args.requests,
        rate=args.rate,
        workload="uneven",
        max_prompt_len=args.max_prompt_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        no_progress=True,
    )
    print(f"afd soak: {job.command_line()}", flush=True)
    started = time.monotonic()
    with Sampler(args.interval) as sampler:
        code, report = run_and_print(job)
    elapsed = time.monotonic() - started
    verified = code == 0 and report is not None
    failures = report.verification["verification_failures"] if report is not None else None
    print(f"\nsampled every {args.interval:g} s over {elapsed:.0f} s:")
    passed = verified and not failures
    summary = {}
    for entry in sorted(sampler.ranks.values(), key=lambda r: r.name):
        ok, text = entry.verdict()
        passed = passed and ok
        summary[entry.name] = {"ok": ok, "rss": entry.rss, "fds": entry.fds}
        print(f"  {entry.name:10s} {len(entry.rss):5d} samples  {text}  {'ok' if ok else 'GREW'}")
    if not sampler.ranks:
        passed = False
        print("  no rank process was seen")
    if args.json is not None:
        args.json.write_text(json.dumps({"elapsed_s": elapsed, "ranks": summary}, indent=1))
    verdict = "PASS" if passed else "FAIL"
    why = "" if verified else f" (afd run ended with {code})"
    print(f"{verdict}: outputs verified, no rank grew{why}" if passed else f"{verdict}{why}")
    return 0 if passed else 1
