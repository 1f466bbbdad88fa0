"""Simulate a deployment on a workload: the requests of ``afd run``, every mode, its
report's numbers (:class:`afd_tools.prefill.metrics.ModeSummary`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from afd_models import DeepseekConfig
from afd_tools.prefill.metrics import ModeSummary, percentile, summarize
from afd_tools.prefill.workload import PULL, Request, assign
from afd_tools.sim.costs import Calibration, CostModel, Shapes, SimError, Wire, share_scale
from afd_tools.sim.modes import COLOCATED, MODES, ModeRun, Setup, Simulation


@dataclass(frozen=True)
class Deployment:
    """Everything but the workload: shapes, ranks, wire, costs."""

    shapes: Shapes
    setup: Setup
    wire: Wire
    calibration: Calibration
    attention_scale: float = 1.0
    """Each attention rank's compute against the calibration's (:func:`share_scale`)."""
    ffn_scale: float = 1.0

    def costs(self, shares: bool = True) -> CostModel:
        """The cost model; without ``shares``, at the calibration's own SM shares (the
        colocated baselines: the share options describe the AFD ranks)."""
        s = self.setup
        scales = (self.attention_scale, self.ffn_scale) if shares else (1.0, 1.0)
        return CostModel(
            self.calibration, self.shapes, s.attention_ranks, s.ffn_ranks, self.wire, *scales
        )


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
    attention_share: float | None = None,
    ffn_share: float | None = None,
) -> Deployment:
    """Check the options (one :class:`SimError` naming the bad one) and bundle them.
    ``attention_share`` / ``ffn_share``: percent of one GPU's SMs each rank of the role
    holds under CUDA MPS (None: the calibration's)."""
    problems = []
    scales = []
    for option, calibrated, share in (
        ("--attention-share", calibration.attention_share, attention_share),
        ("--ffn-share", calibration.ffn_share, ffn_share),
    ):
        try:
            scales.append(share_scale(calibrated, share, option))
        except SimError as exc:
            problems.append(str(exc))
    if attention_ranks < 1 or ffn_ranks < 1:
        problems.append("--attention-ranks and --ffn-ranks must be >= 1")
    elif (attention_share is not None or ffn_share is not None) and not problems:
        a = attention_share if attention_share is not None else calibration.attention_share
        f = ffn_share if ffn_share is not None else calibration.ffn_share
        if a is not None and f is not None and attention_ranks * a + ffn_ranks * f > 100.0 + 1e-9:
            problems.append(
                f"--attention-share/--ffn-share: {attention_ranks} x {a:g} % + {ffn_ranks} x "
                f"{f:g} % is {attention_ranks * a + ffn_ranks * f:g} % of one GPU's SMs; the "
                f"ranks share one GPU, so give shares that add up to at most 100 %"
            )
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
    return Deployment(shapes, setup, wire, calibration, *scales)


def simulate_mode(
    dep: Deployment, mode: str, requests: Sequence[Request], policy: str | None = "round-robin"
) -> ModeRun:
    """One mode; ``requests`` assigned over the A replicas (colocated dp-ep re-assigns
    them over A+F by the same policy, as ``afd run`` does). Under ``pull`` the mode's
    replicas (A+F in dp-ep) claim them from one shared pool as they run; with ``policy``
    ``None`` the requests are already assigned over the mode's own replicas (a measured
    run's assignment in that mode, :meth:`MeasuredRun.assignment
    <afd_tools.sim.measured.MeasuredRun.assignment>`) and are simulated as they are."""
    if mode not in MODES:
        raise SimError(f"unknown mode {mode!r}; choose from {list(MODES)}")
    s = dep.setup
    pull = policy == PULL
    if mode == "colocated" and s.colocated == "dp-ep" and policy is not None and not pull:
        requests = reassign(requests, s.attention_ranks + s.ffn_ranks, policy)
    costs = dep.costs(shares=mode != "colocated")
    return Simulation(mode, s, costs, requests, pull).run()


def reassign(
    requests: Sequence[Request], replicas: int, policy: str = "round-robin"
) -> list[Request]:
    """The same requests assigned over ``replicas`` (under ``pull``: left unassigned)."""
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
