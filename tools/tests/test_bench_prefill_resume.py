"""``afd bench prefill --time-budget`` and ``--resume``: a matrix too long for one sitting
(a lent GPU runs one command for ten minutes) stops before a run that would not fit and is
continued by the same command, keeping what was measured."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from test_bench_prefill_matrix import SMALL_QUICK

from afd_tools.cli import main


def _bench(tmp_path: Path, *extra: str, printed: io.StringIO | None = None) -> tuple[int, str]:
    """One small matrix on the CPU (a warm-up, 2:1 at one stage and at two), as
    test_bench_prefill_matrix's fixture runs it, with ``extra`` options; what it prints
    goes to ``printed`` (kept by the caller when the benchmark raises) and is returned."""
    from afd_tools.bench import prefill

    argv = [
        "bench", "prefill", "--quick", "--preset", "tiny", "--workload", "uniform",
        "--layout", "2:1", "--stages", "1", "--stages", "2", "--run-arg=--device",
        "--run-arg=cpu", "--warm-up", "on", *extra,
    ]  # fmt: skip
    printed = io.StringIO() if printed is None else printed
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(prefill, "QUICK", SMALL_QUICK)
        code = main(argv)
    return code, printed.getvalue()


@pytest.mark.timeout(600)
def test_a_matrix_stopped_at_its_time_budget_is_resumed_where_it_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "matrix.json"
    # The first run of a sitting always starts; the second would end past one second.
    code, out = _bench(tmp_path, "--json", str(report), "--time-budget", "1")
    assert code == 3, out
    assert "stopped at the time budget (1 s): 1 of 2 runs measured" in out
    assert "[1/2] afd run" in out
    assert "[2/2]" not in out
    first = json.loads(report.read_text())
    assert first["complete"] is False
    assert first["planned_runs"] == 2
    assert len(first["runs"]) == 1
    assert first["runs"][0]["exit_code"] == 0

    code, out = _bench(tmp_path, "--json", str(report), "--resume")
    assert code == 0, out
    assert f"resuming {report}: 1 of 2 runs already measured" in out
    assert "[1/2]" not in out  # kept, not run again
    assert out.index("[warm-up, not timed] afd run") < out.index("[2/2] afd run")
    done = json.loads(report.read_text())
    assert done["complete"] is True
    assert done["runs"][0] == first["runs"][0]
    assert [(r["stages"], r["exit_code"]) for r in done["runs"]] == [(1, 0), (2, 0)]
    assert len(done["warm_up"]) == 2  # one per sitting
    assert "| tiny | uniform |" in out  # the whole table, both sittings' rows
    assert out.count("| tiny | uniform |") == 4  # async N=1, sync, colocated, async N=2


def test_resume_refuses_another_matrix_and_needs_a_json_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "matrix.json"
    report.write_text(
        json.dumps(
            {
                "size": json.loads(json.dumps(SMALL_QUICK.__dict__)),
                "ttft_slo_s": None,
                "run_args": ["--device", "cpu"],
                "seed": 0,
                "complete": False,
                "planned_runs": 5,
                "warm_up": [],
                "runs": [],
            }
        )
    )
    code, _ = _bench(tmp_path, "--json", str(report), "--resume")
    assert code == 2
    err = capsys.readouterr().err
    assert (
        "was written by another matrix (planned runs 5 (this command: 2); its runs are other "
        "configurations (--layout, --stages, --repeats, ...))" in err
    )
    assert json.loads(report.read_text())["planned_runs"] == 5  # left as it was
    # Another seed (or --run-arg) measures other runs: refused too.
    code, _ = _bench(tmp_path, "--json", str(report), "--resume", "--seed", "3")
    assert code == 2
    err = capsys.readouterr().err
    assert "planned runs 5 (this command: 2); --seed 0 (this command: 3)" in err
    assert "its runs are other configurations (--layout, --stages, --repeats, ...)" in err
    for extra in (["--resume"], ["--time-budget", "60"]):
        code, _ = _bench(tmp_path, *extra)
        assert code == 2
        assert "keep the runs in the --json file; give one" in capsys.readouterr().err
    code, _ = _bench(tmp_path, "--json", str(report), "--time-budget", "nan")
    assert code == 2
    assert "--time-budget must be a finite number of seconds > 0" in capsys.readouterr().err


def test_a_run_that_never_finishes_is_recorded_as_failed_after_two_sittings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run longer than any sitting (each sitting killed during it, as a lent machine's
    time limit does): the file names it as started and unfinished, each sitting counts one
    more start, and the third records it as failed (exit 124) and goes on to the next."""
    from afd_tools.bench import prefill

    report = tmp_path / "matrix.json"
    seen: list[dict[str, int]] = []

    def killed(job: object) -> tuple[int, None]:
        seen.append(json.loads(report.read_text())["unfinished"])
        raise KeyboardInterrupt  # the sitting ends inside the run

    def sitting(*extra: str) -> str:
        printed = io.StringIO()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(prefill, "run_in_fresh_process", killed)
            argv = ("--json", str(report), "--warm-up", "off", *extra)
            with pytest.raises(KeyboardInterrupt):
                _bench(tmp_path, *argv, printed=printed)
        return printed.getvalue()

    sitting()
    plan = json.loads(report.read_text())["plan"]
    assert seen == [{plan[0]: 1}]  # marked before it started
    assert json.loads(report.read_text())["unfinished"] == {plan[0]: 1}
    sitting("--resume")
    assert seen[-1] == {plan[0]: 2}
    out = sitting("--resume")  # run 1 is not started a third time; run 2 is, and killed too
    assert "[1/2] not started again: 2 sittings started it and none saw it finish" in out
    assert "recorded as failed (exit 124)" in out
    data = json.loads(report.read_text())
    assert [(r["stages"], r["exit_code"]) for r in data["runs"]] == [(1, 124)]
    assert "report" not in data["runs"][0]
    assert data["unfinished"] == {plan[1]: 1}
    assert seen[-1] == {plan[1]: 1}
    code, out = _bench(tmp_path, "--json", str(report), "--resume", "--time-budget", "1")
    assert code == 1, out  # run 2 measured this time; run 1 stays failed
    assert "[1/2]" not in out
    assert "failed (exit 124)" in out
    data = json.loads(report.read_text())
    assert data["complete"] is True
    assert data["unfinished"] == {}
    assert [(r["stages"], r["exit_code"]) for r in data["runs"]] == [(1, 124), (2, 0)]
