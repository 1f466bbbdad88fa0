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

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd_models import DeepseekConfig, preset
from afd_tools.prefill.run_report import RunReport
from afd_tools.prefill.typed_json import ReportError
from afd_tools.prefill.workload import Request
from afd_tools.sim.costs import SimError, Wire


@dataclass(frozen=True)
class MeasuredRun:
    """One ``afd run`` report: the deployment, the exact requests, and what each mode
    measured (the ``modes`` object of the report)."""

    source: str
    device: str
    preset: str
    layers: int | None
    dtype: str
    attention_ranks: int
    ffn_ranks: int
    budget: int
    stages: int
    colocated: str
    assign: str
    wire: Wire
    workload: str
    requests: tuple[Request, ...]
    modes: dict[str, dict[str, Any]]

    @property
    def config(self) -> DeepseekConfig:
        return preset(self.preset, num_layers=self.layers)

    @property
    def label(self) -> str:
        """The configuration, without the repetition: runs with one label are repeats."""
        return (
            f"{self.attention_ranks}A{self.ffn_ranks}F {self.workload} "
            f"{len(self.requests)} req, budget {self.budget}, stages {self.stages}"
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


def measured_run(report: RunReport, where: str) -> MeasuredRun:
    """The simulator's view of a typed run report."""
    d = report.deployment
    return MeasuredRun(
        source=where,
        device=d.device,
        preset=d.preset,
        layers=d.layers,
        dtype=d.dtype,
        attention_ranks=d.attention_ranks,
        ffn_ranks=d.ffn_ranks,
        budget=d.max_num_batched_tokens,
        stages=d.stages,
        colocated=d.colocated,
        assign=d.assign,
        wire=Wire(d.wire_format, d.combine_reduce, d.shared),
        workload=d.workload_name,
        requests=tuple(
            Request(r.request_id, r.prompt_len, r.arrival, r.replica) for r in report.requests
        ),
        modes={m: s.to_json() for m, s in report.modes.items()},
    )


# The unversioned report (schema 1), as afd run wrote it before RunReport: the deployment
# only as the ``args`` strings of its command line. Kept so that old measurements -- the
# shipped run bundle among them -- still load.


def _legacy_arg(args: dict[str, Any], key: str, where: str) -> str:
    if key not in args:
        raise SimError(f"{where}: the report's args lack {key!r} (not an afd run --json report?)")
    return str(args[key])


def _legacy_none_or_int(value: str) -> int | None:
    return None if value == "None" else int(value)


def parse_legacy_report(report: Any, where: str) -> MeasuredRun:
    """A :class:`MeasuredRun` from an unversioned ``afd run --json`` object (no
    ``schema``): its deployment parsed back from the ``args`` strings."""
    if not isinstance(report, dict) or "args" not in report or "modes" not in report:
        raise SimError(f"{where}: not an afd run --json report (no 'args' and 'modes')")
    args = report["args"]
    try:
        requests = tuple(
            Request(
                int(r["request_id"]), int(r["prompt_len"]), float(r["arrival"]), int(r["replica"])
            )
            for r in report["requests"]
        )
        workload_file = _legacy_arg(args, "workload_file", where)
        workload = (
            Path(workload_file).stem
            if workload_file != "None"
            else _legacy_arg(args, "workload", where)
        )
        return MeasuredRun(
            source=where,
            device=_legacy_arg(args, "device", where),
            preset=_legacy_arg(args, "preset", where),
            layers=_legacy_none_or_int(_legacy_arg(args, "layers", where)),
            dtype=_legacy_arg(args, "dtype", where),
            attention_ranks=int(_legacy_arg(args, "attention_ranks", where)),
            ffn_ranks=int(_legacy_arg(args, "ffn_ranks", where)),
            budget=int(_legacy_arg(args, "max_num_batched_tokens", where)),
            stages=int(_legacy_arg(args, "stages", where)),
            colocated=_legacy_arg(args, "colocated", where),
            assign=_legacy_arg(args, "assign", where),
            wire=Wire(
                _legacy_arg(args, "wire_format", where),
                _legacy_arg(args, "combine_reduce", where),
                _legacy_arg(args, "shared", where),
            ),
            workload=workload,
            requests=requests,
            modes=dict(report["modes"]),
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


def bundle(paths: list[Path], command: str, notes: str) -> dict[str, Any]:
    """One run bundle of every report in ``paths`` (each checked to parse), named by its
    file name; bundles and bench files are flattened into it."""
    reports = []
    for path in paths:
        for where, name, report in _reports(_load(path), path):
            parse_report(report, where)
            reports.append({"source": name, "report": report})
    if not reports:
        raise SimError("no measured runs in the given files")
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
