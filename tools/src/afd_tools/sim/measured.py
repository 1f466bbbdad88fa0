"""Measured runs as ``afd sim calibrate`` reads them: ``afd run --json`` reports (typed,
:class:`~afd_tools.prefill.run_report.RunReport`; or unversioned, from before it), the
``afd bench prefill --json`` file that holds several of them, or a *run bundle*.

A run bundle (``afd sim bundle``) keeps a whole measurement campaign in one gzip-compressed
JSON file: every report, under the name it was measured as, with the command and notes
that describe the campaign. The shipped ``cpu-tiny`` calibration is fitted from one
(``calibrations/cpu-tiny-runs.json.gz``), so anyone can refit it or rerun ``afd sim
validate`` on the measurements it came from, and CI checks the simulator against them.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_models import DeepseekConfig, preset
from afd_tools.prefill.metrics import ModeSummary
from afd_tools.prefill.run_report import Deployment, RunReport, role_shares
from afd_tools.prefill.typed_json import ReportError
from afd_tools.prefill.workload import PULL, Request
from afd_tools.sim.costs import SimError, Wire


@dataclass(frozen=True)
class MeasuredRun:
    """One ``afd run`` report: the deployment, the exact requests, and what each mode
    measured (the report's summaries, by mode). The deployment's fields the simulator
    reads are properties of the run too (``run.budget`` is its batching budget)."""

    source: str
    deployment: Deployment
    requests: tuple[Request, ...]
    modes: dict[str, ModeSummary]
    mps_shares: dict[str, int] = field(default_factory=dict)
    """Each AFD rank's CUDA MPS share in percent, by rank name (empty: no GPU was shared
    under MPS, or a report from before it was recorded)."""
    served_by: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per measured mode of an ``--assign pull`` run, the replica that prefilled each
    request (the report's ``served_by``); empty for the static policies, whose modes the
    simulator assigns as ``afd run`` did, and in reports from before it was recorded."""

    def assignment(self, mode: str) -> tuple[tuple[Request, ...], str | None]:
        """The requests and the policy to simulate ``mode`` with
        (:func:`~afd_tools.sim.simulate.simulate_mode`): the report's requests and its
        ``--assign``; under ``pull``, which the replicas decided while they ran, the
        requests as the mode's replicas served them, and no policy (simulated as
        assigned). A :class:`SimError` for a pull report that does not say."""
        if self.assign != PULL:
            return self.requests, self.assign
        served = self.served_by.get(mode)
        if served is None:
            raise SimError(
                f"{self.source}: an --assign pull run's mode {mode} is simulated with the "
                f"assignment its replicas made, which this report does not record "
                f"(served_by); rerun it with this afd, or measure with --assign round-robin"
            )
        return tuple(
            dataclasses.replace(q, replica=r) for q, r in zip(self.requests, served, strict=True)
        ), None

    def same_measurement(self, other: MeasuredRun) -> bool:
        """Whether ``other`` is this run's report again (read from another file or bundle):
        the same deployment, requests and measured modes, whatever its source."""
        return (self.deployment, self.requests, self.modes) == (
            other.deployment,
            other.requests,
            other.modes,
        )

    @property
    def split(self) -> str:
        """The ranks' SM split: ``attention 25 %, ffn 50 %`` (a role's ranks alike), every
        rank's share otherwise, or ``no MPS shares``."""
        if not self.mps_shares:
            return "no MPS shares"
        roles = role_shares(self.mps_shares)
        if roles is not None:
            return ", ".join(f"{role} {share} %" for role, share in sorted(roles.items()))
        return ", ".join(f"{name} {share} %" for name, share in sorted(self.mps_shares.items()))

    def role_split(self) -> tuple[float, float] | None:
        """(attention, FFN) percent of the SMs each rank held under CUDA MPS; None when no
        shares were recorded. :class:`SimError` when the ranks of a role held different
        shares (the cost model has one share per role)."""
        if not self.mps_shares:
            return None
        roles = role_shares(self.mps_shares)
        if roles is None:
            raise SimError(
                f"{self.source}: the ranks of a role held different SM shares ({self.split}); "
                f"the simulator models one share per role"
            )
        missing = sorted({"attention", "ffn"} - set(roles))
        if missing:
            raise SimError(
                f"{self.source}: its MPS shares name no {' or '.join(missing)} rank "
                f"({self.split}); the simulator needs both roles' shares"
            )
        return float(roles["attention"]), float(roles["ffn"])

    @property
    def device(self) -> str:
        return self.deployment.device

    @property
    def preset(self) -> str:
        return self.deployment.preset

    @property
    def layers(self) -> int | None:
        return self.deployment.layers

    @property
    def dtype(self) -> str:
        return self.deployment.dtype

    @property
    def attention_ranks(self) -> int:
        return self.deployment.attention_ranks

    @property
    def ffn_ranks(self) -> int:
        return self.deployment.ffn_ranks

    @property
    def budget(self) -> int:
        """Tokens per prefill step and replica (``--max-num-batched-tokens``)."""
        return self.deployment.max_num_batched_tokens

    @property
    def stages(self) -> int:
        return self.deployment.stages

    @property
    def min_stage_tokens(self) -> int:
        return self.deployment.min_stage_tokens

    @property
    def colocated(self) -> str:
        """The colocated baseline as the simulator models it (``dp`` or ``dp-ep``). A run
        measured against the monolithic model on a whole GPU (``mono``) has no such mode:
        its ``colocated`` figures are not in :attr:`modes` (:func:`measured_run`), and
        ``dp`` stands in here, only so its AFD modes can be simulated."""
        return "dp" if self.deployment.colocated == MONOLITHIC else self.deployment.colocated

    @property
    def assign(self) -> str:
        return self.deployment.assign

    @property
    def wire(self) -> Wire:
        d = self.deployment
        return Wire(d.wire_format, d.combine_reduce, d.shared)

    @property
    def workload(self) -> str:
        """The workload by name (:attr:`Deployment.workload_name`)."""
        return self.deployment.workload_name

    @property
    def config(self) -> DeepseekConfig:
        return preset(self.preset, num_layers=self.layers)

    @property
    def label(self) -> str:
        """The configuration, without the repetition: runs with one label are repeats. It
        names the requests' assignment unless round-robin, and the SM split of runs under
        CUDA MPS (``2A1F uneven 48 req at 4/s, assign pull, budget 16384, stages 2,
        attention 25 %, ffn 50 %``)."""
        return (
            f"{self.attention_ranks}A{self.ffn_ranks}F {self.workload} "
            f"{len(self.requests)} req"
            + (f" at {self.deployment.rate:g}/s" if self.deployment.rate is not None else "")
            + (f", assign {self.assign}" if self.assign != "round-robin" else "")
            + f", budget {self.budget}, stages {self.stages}"
            + (f" (>= {self.min_stage_tokens} tokens each)" if self.min_stage_tokens else "")
            + (f", {self.split}" if self.mps_shares else "")
        )


def parse_report(report: Any, where: str) -> MeasuredRun:
    """A :class:`MeasuredRun` from one ``afd run --json`` object: a typed report
    (:class:`~afd_tools.prefill.run_report.RunReport`, with a ``schema``), or an unversioned
    one from before it (:func:`parse_legacy_report`)."""
    if not isinstance(report, dict) or "schema" not in report:
        return parse_legacy_report(report, where)
    try:
        typed = RunReport.from_json(report, where)
    except ReportError as exc:
        raise SimError(str(exc)) from None
    return measured_run(typed, where)


MONOLITHIC = "mono"
"""``afd run --colocated mono``: the whole model in one process on a whole GPU, the
one-GPU baseline. It runs outside the MPS shares the cost model is calibrated at (the
simulator models ``dp`` and ``dp-ep``), so its measurements are left out of calibrations
and validations; any other colocated value the simulator does not know stays an error."""


def measured_run(report: RunReport, where: str) -> MeasuredRun:
    """The simulator's view of a typed run report (without a ``mono`` colocated mode:
    :data:`MONOLITHIC`)."""
    modes = dict(report.modes)
    if report.deployment.colocated == MONOLITHIC:
        modes.pop("colocated", None)
    return MeasuredRun(
        source=where,
        deployment=report.deployment,
        requests=tuple(
            Request(r.request_id, r.prompt_len, r.arrival, r.replica) for r in report.requests
        ),
        modes=modes,
        mps_shares={str(k): int(v) for k, v in report.placement.get("mps_shares", {}).items()},
        served_by=(
            {m: tuple(s) for m, s in report.served_by.items() if m in modes}
            if report.deployment.assign == PULL
            else {}
        ),
    )


# The unversioned report (schema 1), as afd run wrote it before RunReport: the deployment
# only as the ``args`` strings of its command line. Kept so that old measurements -- the
# shipped run bundle among them -- still load.


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, reading the string ``None`` as ``None``."""
    return lambda text: None if text == "None" else parse(text)


def _flag(text: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(f"{text!r} is not True or False")
    return text == "True"


_LEGACY_REQUIRED: dict[str, Callable[[str], Any]] = {
    "device": str,
    "preset": str,
    "layers": _optional(int),
    "dtype": str,
    "attention_ranks": int,
    "ffn_ranks": int,
    "max_num_batched_tokens": int,
    "stages": int,
    "colocated": str,
    "assign": str,
    "wire_format": str,
    "combine_reduce": str,
    "shared": str,
    "workload": str,
    "workload_file": _optional(str),
}
"""The ``args`` every unversioned report has, each with how its string is read."""
_LEGACY_OPTIONAL: dict[str, tuple[Callable[[str], Any], Any]] = {
    "transport": (str, "shm"),
    "backend": (str, "reference"),
    "max_prompt_len": (int, 256),
    "rate": (_optional(float), None),
    "seed": (int, 0),
    "cam_dynamic_quant": (_flag, False),
}
"""The ``args`` that early reports may lack (their options came later): how each is read,
and the value ``afd run`` used before the option existed."""


def _legacy_arg(args: dict[str, Any], key: str, parse: Callable[[str], Any], where: str) -> Any:
    if key not in args:
        raise SimError(f"{where}: the report's args lack {key!r} (not an afd run --json report?)")
    return parse(str(args[key]))


def parse_legacy_report(report: Any, where: str) -> MeasuredRun:
    """A :class:`MeasuredRun` from an unversioned ``afd run --json`` object (no
    ``schema``): its :class:`Deployment` parsed back from the ``args`` strings (the device
    as placed where the report says, since ``args`` may say ``auto``) and its modes read
    as the typed report's are (:meth:`ModeSummary.from_json`)."""
    if not isinstance(report, dict) or "args" not in report or "modes" not in report:
        raise SimError(f"{where}: not an afd run --json report (no 'args' and 'modes')")
    args = report["args"]
    if not isinstance(report["modes"], dict):
        raise SimError(f"{where}: field 'modes' must be an object")
    try:
        modes = {
            m: ModeSummary.from_json(s, where, f"modes.{m}") for m, s in report["modes"].items()
        }
    except ReportError as exc:
        raise SimError(str(exc)) from None
    try:
        values = {
            key: _legacy_arg(args, key, read, where) for key, read in _LEGACY_REQUIRED.items()
        }
        for key, (read, fallback) in _LEGACY_OPTIONAL.items():
            values[key] = _legacy_arg(args, key, read, where) if key in args else fallback
        placed = report.get("placement", {})
        if values["device"] == "auto" and isinstance(placed, dict) and "kind" in placed:
            values["device"] = str(placed["kind"])
        requests = tuple(
            Request(
                int(r["request_id"]), int(r["prompt_len"]), float(r["arrival"]), int(r["replica"])
            )
            for r in report["requests"]
        )
        return MeasuredRun(
            source=where,
            deployment=Deployment(**values),
            requests=requests,
            modes=modes,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SimError(f"{where}: malformed afd run report ({exc!r})") from None


BUNDLE_SCHEMA = "afd-sim-runs/1"


def _load(path: Path) -> Any:
    """A JSON file, gzip-compressed when its name ends in ``.gz``."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return json.load(f)
        return json.loads(path.read_text())
    except OSError as exc:
        raise SimError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SimError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None


def _reports(data: Any, path: Path) -> list[tuple[str, str, Any]]:
    """``(where, name, report)`` for every report a file holds: ``where`` for messages,
    ``name`` for a bundle entry."""
    if isinstance(data, dict) and data.get("schema") == BUNDLE_SCHEMA:
        entries = data.get("reports")
        if not isinstance(entries, list):
            raise SimError(f"{path}: a run bundle's 'reports' must be a list")
        out = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or "report" not in entry:
                raise SimError(f"{path}: reports[{i}] has no 'report'")
            name = str(entry.get("source", f"{path.name}:{i}"))
            out.append((f"{path}:{name}", name, entry["report"]))
        return out
    if isinstance(data, dict) and "runs" in data:  # afd bench prefill
        return [
            (f"{path} run {i}", f"{path.name}:{i}", entry["report"])
            for i, entry in enumerate(data["runs"])
            if isinstance(entry, dict) and "report" in entry
        ]
    return [(str(path), path.name, data)]


def read_runs(paths: list[Path]) -> list[MeasuredRun]:
    """Every run in the given files (``afd run`` reports, ``afd bench prefill`` files, run
    bundles)."""
    out = [
        parse_report(report, where)
        for path in paths
        for where, _, report in _reports(_load(path), path)
    ]
    if not out:
        raise SimError("no measured runs in the given files")
    return out


def bundle(
    paths: list[Path],
    command: str,
    notes: str,
    preset_name: str | None = None,
    exclude: list[Path] | None = None,
) -> dict[str, Any]:
    """One run bundle of every report in ``paths`` (each checked to parse; only those of
    ``preset_name`` when given; none that is the same measurement as a run in the files
    ``exclude`` names, :meth:`MeasuredRun.same_measurement`: a campaign's new runs, when
    its bench file also holds runs bundled before), named by its file name; bundles and
    bench files are flattened into it."""
    known = read_runs(exclude) if exclude else []
    reports = []
    for path in paths:
        for where, name, report in _reports(_load(path), path):
            run = parse_report(report, where)
            if preset_name is not None and run.preset != preset_name:
                continue
            if any(run.same_measurement(other) for other in known):
                continue
            reports.append({"source": name, "report": report})
    if not reports:
        kept = "" if preset_name is None else f" of preset {preset_name}"
        left = " that the excluded files do not already hold" if known else ""
        raise SimError(f"no measured runs{kept}{left} in the given files")
    names = [r["source"] for r in reports]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SimError(f"two reports share a name {repeated[:3]}: bundle each campaign once")
    return {"schema": BUNDLE_SCHEMA, "command": command, "notes": notes, "reports": reports}


def encode_bundle(data: dict[str, Any]) -> bytes:
    """``data`` as gzip-compressed JSON; the same bundle gives the same bytes (no timestamp
    in the gzip header), so a re-bundled campaign shows no change in git."""
    raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    return gzip.compress(raw, compresslevel=9, mtime=0)
