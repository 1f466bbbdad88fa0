"""The report ``afd run --json`` writes, as typed data: what was deployed, the exact
requests, each mode's summary and the verification, under a schema version.

``afd run`` builds a :class:`RunReport` and writes :meth:`RunReport.to_json`; readers (the
simulator's calibration, ``afd sim validate`` and ``bundle``) take it back with
:meth:`RunReport.from_json`, which checks every field and names the file and the field when
one is missing or of the wrong type. The file still carries ``args`` (every ``afd run``
option as a string) for a person reading it; no reader takes anything from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_tools.prefill.metrics import ModeSummary
from afd_tools.prefill.typed_json import (
    ReportError,
    check_value,
    dataclass_from_json,
    field_error,
)
from afd_tools.prefill.workload import Request

SCHEMA = "afd-run-report/2"
"""The schema of :meth:`RunReport.to_json`. Version 1 is the unversioned report (no
``schema`` key, the deployment only in ``args`` strings) that ``afd run`` wrote before."""

VERIFICATION_PREFIX = "verification_"
"""The verdict's fields sit at the top level of the report, each named with this prefix."""


@dataclass(frozen=True)
class Deployment:
    """The deployment a run measured, as ``afd run`` resolved it (device defaults applied).

    ``afd run`` derives it from its job (``afd_tools.run.job.RunJob.deployment``: each field
    here is the job's field of the same name), and the simulator reads it back."""

    device: str
    """``cpu`` or ``cuda`` (never ``auto``: the device the ranks ran on)."""
    preset: str
    layers: int | None
    """The layer count given to override the preset's (``None``: the preset's own)."""
    dtype: str
    attention_ranks: int
    ffn_ranks: int
    max_num_batched_tokens: int
    """Tokens per prefill step and replica: the batching budget."""
    stages: int
    colocated: str
    """The colocated baseline: ``dp``, ``dp-ep`` or ``mono``."""
    assign: str
    wire_format: str
    combine_reduce: str
    shared: str
    """Where shared experts run: ``attention`` or ``ffn``."""
    transport: str
    backend: str
    workload: str
    """The ``--workload`` preset (ignored where :attr:`workload_file` is given)."""
    workload_file: str | None
    max_prompt_len: int
    rate: float | None
    """Poisson arrivals per second (``None``: all at once)."""
    seed: int
    cam_dynamic_quant: bool = False
    exchange_graphs: int = 0
    """Token counts the attention ranks held as CUDA graphs of the exchange (0: eager)."""
    ffn_graph: bool = False
    """The FFN ranks served from one CUDA graph of serve steps."""
    peer_puts: bool = False
    """Every slot was sent with NVSHMEM device puts from local staging (``--peer-puts``)."""
    min_stage_tokens: int = 0
    """Async mode: fewer stages in steps under this many tokens per stage (0: none)."""
    warm_pass: bool = False
    """Every request was prefilled once, untimed, before the timed modes."""
    baseline_warm_pass: bool = False
    """The colocated baseline's processes ran that pass too. Written since ecd16db (absent,
    so False, before): until 5746507 the monolithic model's own process (``--colocated
    mono``) ran cold even with :attr:`warm_pass` (:attr:`baseline_ran_cold`); reports of
    5746507 to ecd16db, whose baseline was warm, read as cold too (no GPU run was made
    there)."""

    @property
    def baseline_ran_cold(self) -> bool:
        """Whether this run's colocated mode ran cold while its AFD modes ran warm: the
        monolithic baseline of a report without :attr:`baseline_warm_pass` (on one H200 it
        stalled 3.3-5.2 s after its first step), which is no baseline to compare the AFD
        modes with."""
        return self.warm_pass and not self.baseline_warm_pass and self.colocated == "mono"

    @property
    def workload_name(self) -> str:
        """The workload by name: the file's stem, else the preset."""
        return Path(self.workload_file).stem if self.workload_file is not None else self.workload

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Deployment:
        return dataclass_from_json(cls, obj, where, "deployment")


@dataclass(frozen=True)
class RunReport:
    """One ``afd run``: what ran, on which requests, and what each mode measured."""

    deployment: Deployment
    requests: tuple[Request, ...]
    """Every request, in request-id order, with the replica it was given before the run
    (``-1`` under ``--assign pull``: :data:`~afd_tools.prefill.workload.UNASSIGNED`)."""
    modes: dict[str, ModeSummary]
    """Each mode's summary, in the order the modes ran."""
    ratios: dict[str, float] = field(default_factory=dict)
    placement: dict[str, Any] = field(default_factory=dict)
    """Every rank's device and how the ranks shared GPUs (see ``afd run``)."""
    verification: dict[str, Any] = field(default_factory=dict)
    """The verdict's fields (``verification_failures``, ``verification_worst``, ...), each
    written at the top level of the report under its own name."""
    args: dict[str, str] = field(default_factory=dict)
    """Every ``afd run`` option as a string, for a person reading the file."""
    served_by: dict[str, list[int]] = field(default_factory=dict)
    """Per mode, the replica that prefilled each request of :attr:`requests` (in their
    order): the assignment the mode made, which under ``--assign pull`` differs from mode
    to mode, and in colocated dp-ep counts A+F ranks. Empty in reports written before it
    was recorded."""

    def __post_init__(self) -> None:
        for mode, summary in self.modes.items():
            if summary.mode != mode:
                raise ValueError(f"modes[{mode!r}] holds the summary of mode {summary.mode!r}")
        for key in self.verification:
            if not key.startswith(VERIFICATION_PREFIX):
                raise ValueError(f"verification field {key!r} lacks {VERIFICATION_PREFIX!r}")
        problem = _served_problem(self.served_by, self.modes, len(self.requests))
        if problem is not None:
            raise ValueError(f"{problem[0]} {problem[1]}")

    def to_json(self) -> dict[str, Any]:
        """The report as JSON data (pass it through ``json_safe`` before writing: a float
        that is not finite is written as a string)."""
        return {
            "schema": SCHEMA,
            "deployment": self.deployment.to_json(),
            "args": dict(self.args),
            "placement": dict(self.placement),
            "modes": {m: s.to_json() for m, s in self.modes.items()},
            "ratios": dict(self.ratios),
            "requests": [_request_json(r) for r in self.requests],
            **({"served_by": dict(self.served_by)} if self.served_by else {}),
            **self.verification,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> RunReport:
        """A report from :meth:`to_json`'s data (as read back from the file ``where``); a
        :class:`ReportError` naming ``where`` and the field when it is not one."""
        if not isinstance(obj, dict):
            raise ReportError(f"{where}: not an afd run report (not a JSON object)")
        schema = obj.get("schema")
        if schema != SCHEMA:
            raise field_error(
                where,
                "schema",
                f"is {schema!r}: this afd reads run reports of schema {SCHEMA!r} (and the "
                "unversioned reports from before it)",
            )
        for key in ("deployment", "requests", "modes"):
            if key not in obj:
                raise field_error(where, key, "is missing")
        modes_obj = check_value(obj["modes"], dict[str, Any], where, "modes")
        modes = {m: ModeSummary.from_json(s, where, f"modes.{m}") for m, s in modes_obj.items()}
        for m, s in modes.items():
            if s.mode != m:
                raise field_error(where, f"modes.{m}.mode", f"is {s.mode!r}, not {m!r}")
        requests = check_value(obj["requests"], list[Any], where, "requests")
        served = check_value(obj.get("served_by", {}), dict[str, list[int]], where, "served_by")
        problem = _served_problem(served, modes, len(requests))
        if problem is not None:
            raise field_error(where, *problem)
        return cls(
            deployment=Deployment.from_json(obj["deployment"], where),
            requests=tuple(
                dataclass_from_json(Request, r, where, f"requests[{i}]")
                for i, r in enumerate(requests)
            ),
            modes=modes,
            served_by=served,
            ratios=check_value(obj.get("ratios", {}), dict[str, float], where, "ratios"),
            placement=check_value(obj.get("placement", {}), dict[str, Any], where, "placement"),
            verification={k: v for k, v in obj.items() if k.startswith(VERIFICATION_PREFIX)},
            args=check_value(obj.get("args", {}), dict[str, str], where, "args"),
        )


def _served_problem(
    served: dict[str, list[int]], modes: dict[str, ModeSummary], requests: int
) -> tuple[str, str] | None:
    """The field of a report's ``served_by`` that is wrong and why, or None."""
    for mode, replicas in served.items():
        name = f"served_by.{mode}"
        if mode not in modes:
            return name, f"names no mode of the report ({', '.join(modes)})"
        if len(replicas) != requests or any(r < 0 for r in replicas):
            return name, f"must give a replica (>= 0) for each of the {requests} requests"
    return None


def role_shares(mps_shares: dict[str, int]) -> dict[str, int] | None:
    """Each role's CUDA MPS share (``{"attention": 25, "ffn": 50}``) from the report's
    per-rank ``mps_shares`` (``"attention rank 0": 25, ...``), in the order the roles
    appear; ``None`` where the ranks of a role hold different shares."""
    by_role: dict[str, set[int]] = {}
    for name, share in mps_shares.items():
        by_role.setdefault(name.split(" rank ")[0], set()).add(int(share))
    if any(len(values) != 1 for values in by_role.values()):
        return None
    return {role: next(iter(values)) for role, values in by_role.items()}


def _request_json(request: Request) -> dict[str, Any]:
    out = dict(request.__dict__)
    if request.tokens is not None:
        out["tokens"] = list(request.tokens)
    return out
