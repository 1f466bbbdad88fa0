"""``afd bench prefill --resume``: continue a benchmark whose JSON holds some of its runs.

A full-size matrix on one GPU takes longer than one sitting allows (a lent machine runs
one command for at most ten minutes), so the benchmark can stop at ``--time-budget`` and be
run again, the same command with ``--resume``: the runs its ``--json`` file already holds
are kept as they were measured (whatever their exit code: a failed run fails again, and a
re-run would hide that it failed once), and only the others run. The file must come from
the same matrix: the same sizes, TTFT SLO, ``--run-arg`` options, seed and planned runs,
or the resume is refused with what differs. The first run of a sitting always starts, so
a sitting whose budget is shorter than the longest run still makes progress (a caller
with a hard limit leaves room for one run: ``tools/gpu/main-job`` skips a benchmark when
less than ``MAIN_JOB_MIN_LEFT`` seconds are left).

A run longer than any sitting would start again in every one and never end: the file
names each run that was started and has not finished (``unfinished``: its place in the
matrix and how many sittings started it), and after :data:`UNFINISHED_LIMIT` such starts a
resume records it as failed (exit status 124, no report) and goes on with the others.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from afd_tools.bench.prefill_matrix import Point, Size
from afd_tools.bench.prefill_table import BenchRun
from afd_tools.prefill.run_report import RunReport
from afd_tools.prefill.typed_json import ReportError
from afd_tools.run.job import RunJob

UNFINISHED_LIMIT = 2
"""Sittings that may start a run that then never finishes (killed at a time limit): one
might have been a slow machine, two say the run does not fit in a sitting."""
NOT_FINISHED_EXIT = 124
"""The exit status a run that never finished is recorded with (``timeout``'s)."""


class ResumeError(ValueError):
    """A ``--json`` file that ``--resume`` cannot continue; the message says why."""


_POINT_DEFAULTS: dict[str, Any] = {
    f.name: None if f.default is dataclasses.MISSING else f.default
    for f in dataclasses.fields(Point)
}
"""Every field of a run's place in the matrix, with the default a file written before the
field existed stands for (``repeat``: 0)."""


def point_key(point: Point) -> str:
    """A run's place in the matrix as a string that equal points share."""
    return json.dumps(point.to_json(), sort_keys=True)


@dataclasses.dataclass
class Resumed:
    """What a benchmark file already holds of a plan."""

    kept: dict[int, BenchRun] = dataclasses.field(default_factory=dict)
    """Plan index -> the run as it was measured."""
    warm_up: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The warm-up records."""
    unfinished: dict[int, int] = dataclasses.field(default_factory=dict)
    """Plan index -> sittings that started the run and never saw it finish."""


def unfinished_json(unfinished: dict[int, int], runs: Sequence[tuple[Point, RunJob]]) -> Any:
    """``unfinished`` as a benchmark file keeps it: point key -> sittings."""
    return {point_key(runs[index][0]): count for index, count in sorted(unfinished.items())}


def resumed_runs(
    path: Path,
    runs: Sequence[tuple[Point, RunJob]],
    size: Size,
    ttft_slo: float | None,
    run_args: list[str],
    seed: int,
) -> Resumed:
    """The runs of the plan ``runs`` that ``path`` already holds, its warm-up records and
    the runs started but not finished; nothing when ``path`` does not exist.
    :class:`ResumeError` when it is not a benchmark file of this plan."""
    if not path.exists():
        return Resumed()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResumeError(f"--resume: cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ResumeError(f"--resume: {path} is not an afd bench prefill --json file")
    differs = [
        f"{name} {data.get(key)!r} (this command: {mine!r})"
        for name, key, mine in (
            ("sizes", "size", json.loads(json.dumps(size.__dict__))),
            ("TTFT SLO", "ttft_slo_s", ttft_slo),
            ("planned runs", "planned_runs", len(runs)),
            ("--run-arg", "run_args", run_args),
            ("--seed", "seed", seed),
        )
        if data.get(key) != mine
    ]
    if data.get("plan") != [point_key(point) for point, _ in runs]:
        differs.append("its runs are other configurations (--layout, --stages, --repeats, ...)")
    if differs:
        raise ResumeError(
            f"--resume: {path} was written by another matrix ({'; '.join(differs)}); give "
            f"the command that wrote it, or another --json file"
        )
    plan = {point_key(point): index for index, (point, _) in enumerate(runs)}
    kept: dict[int, BenchRun] = {}
    for number, entry in enumerate(data["runs"]):
        where = f"{path}: runs[{number}]"
        if not isinstance(entry, dict):
            raise ResumeError(f"--resume: {where} is not an object")
        key = json.dumps(
            {name: entry.get(name, default) for name, default in _POINT_DEFAULTS.items()},
            sort_keys=True,
        )
        index = plan.get(key)
        if index is None:
            raise ResumeError(f"--resume: {where} ({entry.get('command')}) is not in this plan")
        try:
            report = RunReport.from_json(entry["report"], where) if "report" in entry else None
            kept[index] = BenchRun(
                runs[index][0],
                str(entry["command"]),
                int(entry["exit_code"]),
                float(entry["wall_s"]),
                report,
            )
        except (KeyError, TypeError, ValueError, ReportError) as exc:
            raise ResumeError(f"--resume: {where}: {exc}") from None
    warm = data.get("warm_up", [])
    unfinished: dict[int, int] = {}
    raw = data.get("unfinished", {})
    if not isinstance(raw, dict):
        raise ResumeError(f"--resume: {path}: 'unfinished' is not an object")
    for key, count in raw.items():
        index = plan.get(key)
        if index is None or not isinstance(count, int) or count < 1:
            raise ResumeError(
                f"--resume: {path}: unfinished run {key} {count!r} is not in this plan"
            )
        if index not in kept:
            unfinished[index] = count
    return Resumed(kept, list(warm) if isinstance(warm, list) else [], unfinished)
