"""Measured runs as ``afd sim calibrate`` reads them: ``afd run --json`` reports, or the
``afd bench prefill --json`` file that holds several of them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd_models import DeepseekConfig, preset
from afd_tools.run.workload import Request
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


def _arg(args: dict[str, Any], key: str, where: str) -> str:
    if key not in args:
        raise SimError(f"{where}: the report's args lack {key!r} (not an afd run --json report?)")
    return str(args[key])


def _none_or_int(value: str) -> int | None:
    return None if value == "None" else int(value)


def parse_report(report: Any, where: str) -> MeasuredRun:
    """A :class:`MeasuredRun` from one ``afd run --json`` object."""
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
        workload_file = _arg(args, "workload_file", where)
        workload = (
            Path(workload_file).stem if workload_file != "None" else _arg(args, "workload", where)
        )
        return MeasuredRun(
            source=where,
            device=_arg(args, "device", where),
            preset=_arg(args, "preset", where),
            layers=_none_or_int(_arg(args, "layers", where)),
            dtype=_arg(args, "dtype", where),
            attention_ranks=int(_arg(args, "attention_ranks", where)),
            ffn_ranks=int(_arg(args, "ffn_ranks", where)),
            budget=int(_arg(args, "max_num_batched_tokens", where)),
            stages=int(_arg(args, "stages", where)),
            colocated=_arg(args, "colocated", where),
            assign=_arg(args, "assign", where),
            wire=Wire(
                _arg(args, "wire_format", where),
                _arg(args, "combine_reduce", where),
                _arg(args, "shared", where),
            ),
            workload=workload,
            requests=requests,
            modes=dict(report["modes"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SimError(f"{where}: malformed afd run report ({exc!r})") from None


def read_runs(paths: list[Path]) -> list[MeasuredRun]:
    """Every run in the given files (``afd run`` reports or ``afd bench prefill`` files)."""
    out: list[MeasuredRun] = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise SimError(f"cannot read {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise SimError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if isinstance(data, dict) and "runs" in data:  # afd bench prefill
            for i, entry in enumerate(data["runs"]):
                if isinstance(entry, dict) and "report" in entry:
                    out.append(parse_report(entry["report"], f"{path} run {i}"))
        else:
            out.append(parse_report(data, str(path)))
    if not out:
        raise SimError("no measured runs in the given files")
    return out
