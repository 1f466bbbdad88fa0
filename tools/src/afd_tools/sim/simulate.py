"""Simulate a deployment on a workload: the requests of ``afd run``, every mode, its
report's numbers (:class:`afd_tools.prefill.metrics.ModeSummary`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from afd_models import DeepseekConfig
from afd_tools.prefill.metrics import ModeSummary, percentile, summarize
from afd_tools.prefill.workload import Request, assign
from afd_tools.sim.costs import Calibration, CostModel, Shapes, SimError, Wire
from afd_tools.sim.modes import COLOCATED, MODES, ModeRun, Setup, Simulation


@dataclass(frozen=True)
class Deployment:
    """Everything but the workload: shapes, ranks, wire, costs."""

    shapes: Shapes
    setup: Setup
    wire: Wire
    calibration: Calibration

    def costs(self) -> CostModel:
        s = self.setup
        return CostModel(self.calibration, self.shapes, s.attention_ranks, s.ffn_ranks, self.wire)


def deployment(
    config: DeepseekConfig,
    calibration: Calibration,
    *,
    attention_ranks: int,
    ffn_ranks: int,
    budget: int,
    stages: int = 1,
    colocated: str = "dp",
    ffn_batch: int = 1,
    wire: Wire | None = None,
    dtype: str | None = None,
    min_stage_tokens: int = 0,
) -> Deployment:
    """Check the options (one :class:`SimError` naming the bad one) and bundle them."""
    problems = []
    if attention_ranks < 1 or ffn_ranks < 1:
        problems.append("--attention-ranks and --ffn-ranks must be >= 1")
    if budget < 1:
        problems.append(f"--max-num-batched-tokens must be >= 1, got {budget}")
    if stages < 1:
        problems.append(f"--stages must be >= 1, got {stages}")
    if ffn_batch < 1:
        problems.append(f"--ffn-batch must be >= 1, got {ffn_batch}")
    if min_stage_tokens < 0:
        problems.append(f"--min-stage-tokens must be >= 0, got {min_stage_tokens}")
    if colocated not in COLOCATED:
        problems.append(f"--colocated must be one of {list(COLOCATED)}, got {colocated!r}")
    wire = wire or Wire()
    if wire.combine_reduce == "ffn" and wire.format != "per_rank":
        problems.append("--combine-reduce ffn needs --wire-format per_rank")
    if problems:
        raise SimError("; ".join(problems))
    shapes = Shapes.of(config, dtype or calibration.dtype)
    setup = Setup(
        attention_ranks, ffn_ranks, budget, stages, colocated, ffn_batch, min_stage_tokens
    )
    return Deployment(shapes, setup, wire, calibration)


def simulate_mode(
    dep: Deployment, mode: str, requests: Sequence[Request], policy: str = "round-robin"
) -> ModeRun:
    """One mode; ``requests`` assigned over the A replicas (colocated dp-ep re-assigns
    them over A+F by the same policy, as ``afd run`` does)."""
    if mode not in MODES:
        raise SimError(f"unknown mode {mode!r}; choose from {list(MODES)}")
    s = dep.setup
    if mode == "colocated" and s.colocated == "dp-ep":
        requests = reassign(requests, s.attention_ranks + s.ffn_ranks, policy)
    return Simulation(mode, s, dep.costs(), requests).run()


def reassign(
    requests: Sequence[Request], replicas: int, policy: str = "round-robin"
) -> list[Request]:
    """The same requests assigned over ``replicas``."""
    return assign([r.prompt_len for r in requests], [r.arrival for r in requests], replicas, policy)


def summary(run: ModeRun) -> ModeSummary:
    """The report's numbers, computed by the code ``afd run`` uses."""
    return summarize(run.mode, run.requests, run.replicas, run.ffn_intervals)


@dataclass(frozen=True)
class Headline:
    """The figures a sweep compares (cheaper than a whole :class:`ModeSummary`)."""

    makespan_s: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float


def headline(run: ModeRun) -> Headline:
    done: dict[int, float] = {}
    for record in run.replicas:
        done.update(record.done)
    ttft = [done[r.request_id] - r.arrival for r in run.requests]
    makespan = max(done.values())
    return Headline(
        makespan,
        sum(r.prompt_len for r in run.requests) / makespan,
        percentile(ttft, 50),
        percentile(ttft, 99),
    )


def simulate(
    dep: Deployment,
    modes: Iterable[str],
    requests: Sequence[Request],
    policy: str = "round-robin",
) -> dict[str, tuple[ModeRun, ModeSummary]]:
    out = {}
    for mode in modes:
        run = simulate_mode(dep, mode, requests, policy)
        out[mode] = (run, summary(run))
    return out
