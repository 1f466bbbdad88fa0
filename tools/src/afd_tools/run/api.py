"""``afd run`` as a library call: :func:`run_job` launches a job's ranks, runs its modes,
verifies every output and returns the typed report, printing nothing.

::

    from afd_tools.run.api import run_job
    from afd_tools.run.job import RunJob

    report = run_job(RunJob(device="cpu", requests=8, max_prompt_len=48))
    report.modes["async"].tokens_per_s, report.verification["verification_failures"]

Where the caller prints while it runs (``afd run`` prints the plan before launching and
draws a progress bar), it takes the two steps itself: :func:`~afd_tools.run.plan.prepare`
(every configuration error, before anything starts) and :func:`execute`, which also hands
back the verdict and the raw per-launch outcomes (the timeline plot's input).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from afd_models import MonolithicModel, RoundedWeights
from afd_tools.prefill.metrics import ModeSummary, ratios, served_by, summarize
from afd_tools.prefill.run_report import RunReport
from afd_tools.run import ranks
from afd_tools.run.devices import Placement
from afd_tools.run.hardware import hardware_record
from afd_tools.run.job import RunJob
from afd_tools.run.launches import SPAWN, Outcome, launches
from afd_tools.run.plan import RunPlan, prepare
from afd_tools.run.sharing import describe_sharing
from afd_tools.run.verify import Checks, ReferenceBuilder, Verdict, verify
from afd_tools.run.verify_times import VerificationTimes


@dataclass
class RunPhases:
    """Where an ``afd run``'s wall time went, in seconds, summed over its launches: from a
    launch's start to its first mode's start on any replica (process start-up, the
    transport, the models, the warm-up), the modes (to the last request's end), from there
    to the launch's end (shutdown), and the verification. The ranks' mode starts are
    ``time.monotonic()`` in their processes, the same clock on Linux.

    The start-up is split too where the replicas recorded it (``ModeResult.start_marks``),
    as the mean over a launch's replicas: from the launch to the replica's program (its
    process started, its transport connected), the model (weights, the GEMM probe on a
    GPU), and the warm-up; what is left of ``start_s`` is the wait for the slowest rank."""

    start_s: float = 0.0
    modes_s: float = 0.0
    stop_s: float = 0.0
    verification_s: float = 0.0
    processes_s: float = 0.0
    models_s: float = 0.0
    warm_up_s: float = 0.0
    split_launches: int = 0
    """Launches whose start-up is split into the three above."""
    verification: VerificationTimes = field(default_factory=VerificationTimes)
    """Where the verification's time went (its parts, in brackets after its total)."""

    def add_launch(self, launched: float, outcome: Outcome, ended: float) -> None:
        """Add one launch, begun at ``launched`` and ended at ``ended`` (monotonic)."""
        group_modes, _, values, _ = outcome
        results = [replica[mode] for replica in values for mode in group_modes if mode in replica]
        if not results:
            self.start_s += ended - launched
            return
        first = min(r.origin for r in results)
        last = max(r.origin + max(r.done.values(), default=0.0) for r in results)
        self.start_s += first - launched
        self.modes_s += last - first
        self.stop_s += ended - last
        # Every mode of a replica carries the same marks: take its first mode's.
        firsts = (next(iter(replica.values()), None) for replica in values)
        marks = [r.start_marks for r in firsts if r is not None and r.start_marks is not None]
        if marks:
            self.processes_s += statistics.fmean(entered - launched for entered, _, _ in marks)
            self.models_s += statistics.fmean(built - entered for entered, built, _ in marks)
            self.warm_up_s += statistics.fmean(warmed - built for _, built, warmed in marks)
            self.split_launches += 1

    def describe(self) -> str:
        """``start-up and warm-up 9.1 s, modes 2.0 s, stop 0.4 s, verification 5.2 s``;
        where the start-up was split, the split follows it in brackets, and the
        verification's parts (:meth:`VerificationTimes.describe`) follow it."""
        split = (
            f" [per replica: processes and transport {self.processes_s:.1f} s, model "
            f"{self.models_s:.1f} s, warm-up {self.warm_up_s:.1f} s]"
            if self.split_launches
            else ""
        )
        parts = self.verification.describe()
        return (
            f"start-up and warm-up {self.start_s:.1f} s{split}, modes {self.modes_s:.1f} s, "
            f"stop {self.stop_s:.1f} s, verification {self.verification_s:.1f} s"
            + (f" [{parts}]" if parts else "")
        )


@dataclass(frozen=True)
class RunResult:
    """What :func:`execute` measured: the report, and what it was made from."""

    report: RunReport
    verdict: Verdict
    """Every request's check (:meth:`Verdict.pass_line` / :meth:`Verdict.fail_line`)."""
    outcomes: list[Outcome]
    """Per launch: modes, requests, per-replica results by mode, FFN intervals."""
    phases: RunPhases = field(default_factory=RunPhases)
    """Where the run's wall time went."""

    @property
    def passed(self) -> bool:
        """Whether every request of every mode matched the reference."""
        return not self.verdict.failures()


def run_job(job: RunJob) -> RunReport:
    """Run ``job``: launch its ranks, run its modes, verify every output; the report (its
    ``verification`` says whether every output matched). Configuration errors raise
    :class:`~afd_tools.prefill.workload.WorkloadError` or :class:`~afd_protocol.AFDError`
    before any process starts."""
    return execute(prepare(job)).report


def execute(plan: RunPlan, on_request: Callable[[], None] | None = None) -> RunResult:
    """Run the plan's launches one after the other, then verify every request of every mode
    against the monolithic reference. ``on_request`` is called (from a helper thread) each
    time a rank finishes a request's prefill."""
    job = plan.job
    phases = RunPhases()
    outcomes = []
    with _progress(on_request) as progress:
        for build in launches(plan):
            launched = time.monotonic()
            outcome = build(progress).run(job.run_timeout)
            phases.add_launch(launched, outcome, time.monotonic())
            outcomes.append(outcome)
    served = _served(outcomes)  # first: every request prefilled exactly once in every mode
    checked = time.monotonic()
    verdict = Verdict(_verify(plan, outcomes, phases.verification), job.tolerance, job.margin)
    phases.verification_s = time.monotonic() - checked
    summaries: dict[str, ModeSummary] = {}
    for group_modes, group_requests, values, intervals in outcomes:
        for mode in group_modes:
            summaries[mode] = summarize(mode, group_requests, [v[mode] for v in values], intervals)
    summaries = {m: summaries[m] for m in plan.modes}
    report = RunReport(
        deployment=job.deployment(plan.placement.kind),
        requests=tuple(plan.requests),
        modes=summaries,
        served_by={m: served[m] for m in plan.modes},
        ratios=ratios(summaries),
        placement=placement_record(plan.placement, plan.shares),
        verification=verdict.as_json(),
        args=job.as_args(),
    )
    return RunResult(report, verdict, outcomes, phases)


def _served(outcomes: list[Outcome]) -> dict[str, list[int]]:
    """Per mode, the replica that prefilled each request, in request order
    (:func:`~afd_tools.prefill.metrics.served_by`: a :class:`RuntimeError` where a request
    was prefilled twice or never)."""
    return {
        mode: served_by(mode, group_requests, [v[mode] for v in values])
        for group_modes, group_requests, values, _ in outcomes
        for mode in group_modes
    }


def placement_record(placement: Placement, shares: dict[str, int]) -> dict[str, Any]:
    """The report's ``placement``: every rank's device, the colocated baseline in words, how
    the AFD ranks shared GPUs (``mps_shares``: percent by rank name, empty when no GPU was
    shared under MPS), and what it all ran on (``hardware``:
    :func:`~afd_tools.run.hardware.hardware_record`)."""
    return placement.__dict__ | {
        "exchange": placement.exchange,
        "colocated_label": f"colocated: {placement.colocated_label}",
        "sharing": describe_sharing(placement, shares) or "none",
        "mps_shares": dict(shares),
        "hardware": hardware_record(placement.kind),
    }


@contextlib.contextmanager
def _progress(on_request: Callable[[], None] | None) -> Iterator[Connection]:
    """The writing end of a pipe the ranks report finished requests into, while a helper
    thread calls ``on_request`` for each (none reads it without ``on_request``)."""
    reader, writer = SPAWN.Pipe(duplex=False)
    stop = threading.Event()
    thread = None
    if on_request is not None:
        thread = threading.Thread(
            target=_forward_progress, args=(reader, on_request, stop), daemon=True
        )
        thread.start()
    try:
        yield writer
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=5)
        reader.close()
        writer.close()


def _forward_progress(
    progress: Connection, on_request: Callable[[], None], stop: threading.Event
) -> None:
    while not stop.is_set():
        if progress.poll(0.1):
            try:
                progress.recv_bytes()
            except (EOFError, OSError):
                return
            on_request()


def _verify(plan: RunPlan, outcomes: list[Outcome], times: VerificationTimes) -> Checks:
    """Check every request of every mode against the monolithic model on the first
    attention replica's device, with the FFN ranks' expert backend, replaying each
    replica's own steps and following its expert choice at routing near ties; in bfloat16 a
    request that misses the tolerance is checked against the float32 twin too
    (:mod:`afd_tools.run.verify`); ``times`` receives where the time went."""
    job, config = plan.job, plan.config
    dtype = getattr(torch, job.resolved("dtype"))
    device = plan.placement.attention[0]
    backend = job.resolved("backend")
    prompts = {
        r.request_id: ranks.request_tokens(r, config.vocab_size, job.seed)
        for _, requests, _, _ in outcomes
        for r in requests
    }

    def twin() -> MonolithicModel:
        """The reference's float32 twin: its weights rounded to the run's dtype."""
        rounded = RoundedWeights(ranks.random_weights(job.seed, torch.device(device)), dtype)
        return MonolithicModel(config, rounded, dtype=torch.float32, device=device)

    def reference() -> MonolithicModel:
        """The monolithic model in the run's dtype, with the FFN ranks' backend: built by
        verify(), which drops it before the twin is built (the two need not fit in device
        memory together)."""
        weights = ranks.random_weights(job.seed, torch.device(device))
        return MonolithicModel(config, weights, dtype=dtype, device=device, backend=backend)

    notes: list[str] = []
    lower = dtype != torch.float32
    checks = verify(
        ReferenceBuilder(reference),
        outcomes,
        prompts,
        job.margin,
        job.tolerance,
        notes,
        twin if lower else None,
        job.exchange_tolerance,
        job.tie_margin_from,
        times,
    )
    for note in notes:
        print(f"afd run: verification: {note}", file=sys.stderr, flush=True)
    return checks


__all__ = ["RunResult", "execute", "placement_record", "prepare", "run_job"]
