"""``afd bench prefill``'s sweeps: which runs a matrix makes and in what order, what it
refuses before running anything, and a table whose ratios, goodput and best-split notes
follow from the reports (checked against numbers computed here)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from afd_tools.bench.prefill_matrix import (
    FULL,
    QUICK,
    Point,
    check_sweeps,
    expand,
    job_of,
    point_job,
    warm_up_plan,
    warms_up,
)
from afd_tools.bench.prefill_table import (
    BenchRun,
    best_split_notes,
    markdown_table,
    spread_notes,
)
from afd_tools.cli import build_parser, main
from afd_tools.prefill.layer_times import LayerBreakdown
from afd_tools.prefill.metrics import ModeSummary
from afd_tools.prefill.run_report import RunReport
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.job import MODES, RunJob


def _args(*argv: str) -> Any:
    """The sweeps of ``afd bench prefill ARGV`` (and its other options on ``.parsed``)."""
    from afd_tools.bench.prefill import sweeps_of

    return sweeps_of(build_parser().parse_args(["bench", "prefill", *argv]))


def test_a_matrix_runs_every_mode_once_per_group_and_async_alone_at_the_other_stages(
    tmp_path: Path,
) -> None:
    args = _args(
        "--layout", "1:1", "--layout", "2:1", "--stages", "1", "--stages", "4",
        "--rate", "5", "--rate", "20",
    )  # fmt: skip
    base = point_job(args, "tiny", "uneven", QUICK, tmp_path)
    check_sweeps(args, base)
    points = expand(args, base, "tiny", "uneven")
    seen = [(p.attention_ranks, p.ffn_ranks, p.rate, p.stages, p.modes) for p in points]
    assert seen == [
        (a, f, rate, stages, MODES if stages == 1 else ("async",))
        for a, f in [(1, 1), (2, 1)]
        for rate in (5.0, 20.0)
        for stages in (1, 4)
    ]
    job = job_of(base, points[-1])
    assert (job.attention_ranks, job.ffn_ranks, job.rate, job.stages, job.modes) == (
        2,
        1,
        20.0,
        4,
        ("async",),
    )
    line = job.command_line()
    assert "--mode async" in line
    assert "--stages 4" in line
    assert "--rate 20.0" in line
    # Without sweep options: one run, at the benchmark's defaults (1:1, 2 stages).
    plain = _args()
    only = expand(plain, point_job(plain, "tiny", "uneven", QUICK, tmp_path), "tiny", "uneven")
    assert [(p.attention_ranks, p.ffn_ranks, p.stages, p.modes) for p in only] == [(1, 1, 2, MODES)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--layout", "2:1", "--run-arg=--attention-ranks=3"],
            "--layout sweeps what --run-arg=--attention-ranks sets: give it one way",
        ),
        (
            ["--stages", "2", "--run-arg=--stages=1"],
            "--stages sweeps what --run-arg=--stages sets: give it one way",
        ),
        (
            ["--rate", "4", "--run-arg=--rate=8"],
            "--rate sweeps what --run-arg=--rate sets: give it one way",
        ),
        (
            ["--stages", "1", "--stages", "2", "--run-arg=--mode=sync"],
            "several --stages run every mode at the first and async alone at the others: "
            "drop --run-arg=--mode",
        ),
        (
            ["--run-arg=--preset=tiny"],
            "--run-arg=--preset: the benchmark sets it for every run (and labels its rows with "
            "it); use --preset",
        ),
        (
            ["--run-arg=--seed=3"],
            "--run-arg=--seed: the benchmark sets it for every run (and labels its rows with "
            "it); use --seed",
        ),
        (
            ["--run-arg=--requests=100"],
            "--run-arg=--requests: the benchmark sets it for every run (and labels its rows "
            "with it); use the size (--quick or not)",
        ),
        (
            ["--attention-share", "25", "--run-arg=--device=cuda"],
            "--attention-share sets CUDA MPS shares of ranks sharing a GPU: add "
            "--run-arg=--share-gpus",
        ),
        (
            ["--attention-share", "25"],
            "--attention-share sets CUDA MPS shares of ranks sharing a GPU: add "
            "--run-arg=--device=cuda --run-arg=--share-gpus",
        ),
        (
            [
                "--attention-share",
                "25",
                "--run-arg=--device=cuda",
                "--run-arg=--share-gpus",
                "--run-arg=--mps-attention-share=30",
            ],
            "--attention-share sweeps what --run-arg=--mps-attention-share sets: give it one way",
        ),
    ],
)
def test_a_sweep_that_a_run_arg_contradicts_is_refused_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "prefill", "--quick", "--preset", "tiny", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"afd bench prefill: error: {message}"
    assert "[1/" not in captured.out  # nothing ran


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layout", "2"], "'2' is not A:F (attention replicas : FFN ranks, each >= 1), e.g. 2:1"),
        (["--layout", "0:1"], "'0:1' is not A:F"),
        (["--rate", "0"], "'0': a rate is requests per second, > 0"),
        (["--stages", "0"], "'0': stages, a whole number >= 1"),
        (["--rate", "nan"], "'nan': a rate is requests per second, > 0"),
        (["--attention-share", "100"], "'100': an attention rank's share is a whole percent"),
        (["--repeats", "0"], "'0': launches per run, a whole number >= 1"),
        (["--repeats", "two"], "'two': launches per run, a whole number >= 1"),
    ],
)
def test_a_malformed_sweep_value_names_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "prefill", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}: " in err
    assert message in err


def test_a_run_arg_still_sets_what_no_sweep_option_gives(tmp_path: Path) -> None:
    args = _args("--run-arg=--stages=3", "--run-arg=--attention-ranks=2")
    base = point_job(args, "tiny", "uneven", QUICK, tmp_path)
    check_sweeps(args, base)
    (point,) = expand(args, base, "tiny", "uneven")
    assert (point.attention_ranks, point.stages) == (2, 3)  # labelled as it ran


# ---- the table, from reports made here -----------------------------------------------


def _summary(mode: str, tokens_per_s: float, p99: float, ttft: list[float]) -> ModeSummary:
    makespan = 100.0 / tokens_per_s
    return ModeSummary(
        mode=mode,
        makespan_s=makespan,
        tokens_per_s=tokens_per_s,
        ttft_p50=min(ttft, default=0.0),
        ttft_p90=p99,
        ttft_p99=p99,
        attention_busy=[0.5],
        attention_wait=[0.5],
        ffn_busy=[0.5],
        dummy_batches=0,
        breakdown=LayerBreakdown(compute_ms_per_layer=1.0, barrier_ms_per_layer=0.25),
        ttft_s=ttft,
    )


def _run(point: Point, modes: dict[str, ModeSummary], shares: dict[str, int]) -> BenchRun:
    deployment = RunJob(dtype="float32", backend="reference", transport="shm", colocated="dp")
    worst = {m: {"request": 0, "relative_error": 1e-6} for m in modes}
    report = RunReport(
        deployment.deployment("cpu"),
        (),
        modes,
        placement={"kind": "cuda", "mps_shares": shares},
        verification={"verification_failures": {}, "verification_worst": worst},
    )
    return BenchRun(point, "afd run", 0, 1.0, report)


def _point(share: int | None, stages: int, modes: tuple[str, ...]) -> Point:
    return Point("v2-lite", "uneven", 2, 1, share, None, stages, modes)


def test_each_row_is_compared_with_the_sync_run_of_its_own_group() -> None:
    shares = {"attention rank 0": 25, "attention rank 1": 25, "ffn rank 0": 50}
    runs = [
        _run(
            _point(25, 1, MODES),
            {
                "async": _summary("async", 300.0, 1.0, [0.5, 1.0, 3.0]),
                "sync": _summary("sync", 200.0, 2.0, [1.0, 2.0, 2.5]),
                "colocated": _summary("colocated", 400.0, 0.5, [0.25, 0.5]),
            },
            shares,
        ),
        _run(_point(25, 2, ("async",)), {"async": _summary("async", 500.0, 1.5, [1.0])}, shares),
        # Another split: its own sync, so its async is not held against the first one's.
        _run(
            _point(30, 1, MODES),
            {
                "async": _summary("async", 240.0, 3.0, [3.0]),
                "sync": _summary("sync", 120.0, 4.0, [4.0]),
            },
            {"attention rank 0": 30, "attention rank 1": 30, "ffn rank 0": 40},
        ),
        BenchRun(_point(None, 1, MODES), "afd run --broken", 2, 0.5, None),
    ]
    table = markdown_table(runs, ttft_slo_s=2.0)
    lines = table.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:] if "|" in line]
    assert all(len(row) == len(header) for row in rows), rows
    by = {(row[3], row[5]): dict(zip(header, row, strict=True)) for row in rows}
    first = by[("A 25 / F 50", "async N=1")]
    assert first["tokens/s vs sync"] == f"{300 / 200:.2f}x"
    assert first["TTFT p99 vs sync"] == f"{1.0 / 2.0:.2f}x"
    # goodput: requests with TTFT <= 2 s per second of the makespan (100 tokens / 300 per s)
    assert first["goodput at TTFT <= 2 s, req/s"] == f"{2 / (100 / 300):.2f}"
    assert first["per layer: compute / dispatch / combine / barrier ms"] == "1.00 / - / - / 0.25"
    assert by[("A 25 / F 50", "async N=2")]["tokens/s vs sync"] == f"{500 / 200:.2f}x"
    assert by[("A 25 / F 50", "sync")]["tokens/s vs sync"] == "-"
    assert by[("A 25 / F 50", "colocated")]["tokens/s vs sync"] == f"{400 / 200:.2f}x"
    assert by[("A 30 / F 40", "async N=1")]["tokens/s vs sync"] == f"{240 / 120:.2f}x"
    failed = by[("-", "async N=1, sync, colocated")]  # what it was to run
    assert failed["tokens/s"] == "failed (exit 2)"
    assert failed["verified (worst error)"] == "no"
    assert best_split_notes(runs) == [
        "Best SM split, v2-lite uneven 2A1F all at once: async N=2 at A 25 / F 50 "
        "(500 tokens/s); sync at A 25 / F 50 (200 tokens/s)."
    ]
    assert best_split_notes(runs) == [line for line in lines if line.startswith("Best SM")]
    assert "goodput" not in markdown_table(runs)  # no SLO stated, no column


def test_a_monolithic_baseline_that_ran_cold_is_compared_with_nothing() -> None:
    """A report from before 5746507 (the AFD modes warm, the monolithic baseline's process
    not: ``baseline_warm_pass`` absent, so False) shows no colocated ratio, and its repeats
    are left out of the spread by count; a report whose baseline ran the pass is compared,
    and so is any baseline where nothing ran warm (the CPU's default)."""
    modes = {
        "async": _summary("async", 300.0, 1.0, [1.0]),
        "sync": _summary("sync", 200.0, 2.0, [2.0]),
        "colocated": _summary("colocated", 150.0, 3.0, [3.0]),
    }

    def run(repeat: int, warm: bool, baseline: bool, colocated: str = "mono") -> BenchRun:
        entry = _run(dataclasses.replace(_point(None, 1, MODES), repeat=repeat), modes, {})
        assert entry.report is not None
        deployment = dataclasses.replace(
            entry.report.deployment,
            colocated=colocated,
            warm_pass=warm,
            baseline_warm_pass=baseline,
        )
        return dataclasses.replace(
            entry, report=dataclasses.replace(entry.report, deployment=deployment)
        )

    old = run(0, warm=True, baseline=False)
    assert old.report is not None
    assert old.report.deployment.baseline_ran_cold
    old_json = old.report.to_json()
    del old_json["deployment"]["baseline_warm_pass"]  # as a report of before wrote it
    assert RunReport.from_json(old_json, "old").deployment.baseline_ran_cold

    def colocated_row(entry: BenchRun) -> list[str]:
        line = next(x for x in markdown_table([entry]).splitlines() if "| colocated |" in x)
        return [c.strip() for c in line.strip("|").split("|")]

    assert colocated_row(old)[-3:-1] == ["ran cold", "ran cold"]
    for warm_one in (run(0, True, True), run(0, False, False), run(0, True, False, "dp-ep")):
        assert colocated_row(warm_one)[-3:-1] == [f"{150 / 200:.2f}x", f"{3.0 / 2.0:.2f}x"]
    notes = spread_notes([old, run(1, True, False), run(2, True, True)])
    assert (
        "Spread, v2-lite uneven 2A1F all at once, colocated vs sync (1 of 3 repeats verified "
        f"and warm; 2 verified but run cold, left out): tokens/s {0.75:.2f}x (one repeat: no "
        "range), TTFT p99 1.50x (one repeat: no range)."
    ) in notes
    assert (
        "Spread, v2-lite uneven 2A1F all at once, colocated vs sync: no verified repeat that "
        "ran warm."
    ) in spread_notes([old, run(1, True, False)])


def test_repeats_run_each_group_again_and_compare_each_run_with_its_own_sync(
    tmp_path: Path,
) -> None:
    args = _args("--layout", "2:1", "--stages", "1", "--stages", "2", "--repeats", "3")
    points = expand(args, point_job(args, "tiny", "uneven", QUICK, tmp_path), "tiny", "uneven")
    # A/B/A/B: the whole group (every mode at N=1, async at N=2) once per repeat.
    assert [(p.repeat, p.stages) for p in points] == [(r, n) for r in range(3) for n in (1, 2)]
    assert len({p.group for p in points}) == 1

    def repeat_of(r: int, async1: float, sync: float, async2: float) -> list[BenchRun]:
        point = dataclasses.replace(_point(None, 1, ("async", "sync")), repeat=r)
        modes = {
            "async": _summary("async", async1, 1.0, [1.0]),
            "sync": _summary("sync", sync, 2.0, [2.0]),
        }
        second = dataclasses.replace(point, stages=2, modes=("async",))
        return [
            _run(point, modes, {}),
            _run(second, {"async": _summary("async", async2, 1.5, [1.0])}, {}),
        ]

    runs = [
        *repeat_of(0, 300.0, 200.0, 240.0),  # N=1 1.5x, N=2 1.2x
        *repeat_of(1, 330.0, 300.0, 450.0),  # this repeat's sync was faster: 1.1x, 1.5x
        *repeat_of(2, 200.0, 100.0, 150.0),  # 2.0x, 1.5x
    ]
    table = markdown_table(runs)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    by = {row[5]: row for row in rows if len(row) > 5}
    assert by["async N=1, run 2 of 3"][-3] == f"{330 / 300:.2f}x"  # against its own sync
    assert by["async N=2, run 3 of 3"][-3] == f"{150 / 100:.2f}x"
    notes = spread_notes(runs)
    assert notes == [
        "Spread, v2-lite uneven 2A1F all at once, async N=1 vs sync (3 of 3 repeats "
        f"verified): tokens/s median {1.5:.2f}x ({1.1:.2f}-{2.0:.2f}x), TTFT p99 median "
        "0.50x (0.50-0.50x).",
        "Spread, v2-lite uneven 2A1F all at once, async N=2 vs sync (3 of 3 repeats "
        f"verified): tokens/s median {1.5:.2f}x ({1.2:.2f}-{1.5:.2f}x), TTFT p99 median "
        "0.75x (0.75-0.75x).",
    ]
    assert all(note in table for note in notes)
    # One launch each: no spread line, and the labels name no run.
    assert spread_notes([r for r in runs if r.point.repeat == 0]) == []
    assert "run 1 of" not in markdown_table([r for r in runs if r.point.repeat == 0])
    # A stopped benchmark: labelled against the plan's count, not the runs it has.
    assert "async N=1, run 1 of 3" in markdown_table(runs[:2], repeats=3)

    # Only verified comparisons count: repeat 1's sync unverified (its 9x ratio must not
    # count), repeat 2's async at N=2 unverified, and repeat 2's N=1 run lost.
    bad_sync = repeat_of(1, 900.0, 100.0, 450.0)
    verification = dict(bad_sync[0].report.verification)
    verification["verification_failures"] = {"sync": ["request 0: NaN"]}
    bad_sync[0] = dataclasses.replace(
        bad_sync[0], report=dataclasses.replace(bad_sync[0].report, verification=verification)
    )
    third = repeat_of(2, 200.0, 100.0, 150.0)
    lost = BenchRun(third[0].point, "afd run", 1, 1.0, None)
    bad_async = dict(third[1].report.verification)
    bad_async["verification_failures"] = {"async": ["request 3: 0.5 off"]}
    unverified = dataclasses.replace(
        third[1], report=dataclasses.replace(third[1].report, verification=bad_async)
    )
    mixed = [*repeat_of(0, 300.0, 200.0, 240.0), *bad_sync, lost, unverified]
    assert spread_notes(mixed) == [
        "Spread, v2-lite uneven 2A1F all at once, async N=1 vs sync (1 of 3 repeats "
        f"verified): tokens/s {1.5:.2f}x (one repeat: no range), TTFT p99 0.50x (one repeat: "
        "no range).",
        "Spread, v2-lite uneven 2A1F all at once, async N=2 vs sync (1 of 3 repeats "
        f"verified): tokens/s {1.2:.2f}x (one repeat: no range), TTFT p99 0.75x (one "
        "repeat: no range).",
    ]
    # The lost run's row names what it was to run, and which launch, once.
    assert "| async N=1, sync (run 3 of 3) | failed (exit 1) |" in markdown_table(mixed)
    only_bad = [*bad_sync]
    assert spread_notes(only_bad, repeats=3) == [
        "Spread, v2-lite uneven 2A1F all at once, async N=1 vs sync: no verified repeat.",
        "Spread, v2-lite uneven 2A1F all at once, async N=2 vs sync: no verified repeat.",
    ]


def test_the_best_split_is_the_best_median_over_repeats_not_the_luckiest_launch() -> None:
    def launch(share: int, repeat: int, tokens: float) -> BenchRun:
        point = dataclasses.replace(_point(share, 1, ("async", "sync")), repeat=repeat)
        shares = {"attention rank 0": share, "attention rank 1": share, "ffn rank 0": 50}
        modes = {
            "async": _summary("async", tokens, 1.0, [1.0]),
            "sync": _summary("sync", 100.0, 2.0, [2.0]),
        }
        return _run(point, modes, shares)

    # Split 20: one lucky launch (900) among slow ones; split 25: steady at 400.
    runs = [launch(20, r, t) for r, t in enumerate((900.0, 200.0, 210.0))]
    runs += [launch(25, r, 400.0) for r in range(3)]
    (note,) = best_split_notes(runs)
    assert note.startswith(
        "Best SM split, v2-lite uneven 2A1F all at once: async N=1 at A 25 / F 50 "
        "(400 tokens/s, median of 3 launches)"
    ), note


def test_a_mode_summary_counts_goodput_against_the_slo() -> None:
    summary = _summary("async", 50.0, 1.0, [0.5, 1.0, 1.0001, 7.0])  # makespan 2 s
    assert summary.goodput(1.0) == 2 / 2.0
    assert summary.goodput(10.0) == 4 / 2.0
    assert _summary("sync", 50.0, 1.0, []).goodput(1.0) is None  # an older report


@dataclasses.dataclass(frozen=True)
class SmallMatrix:
    out: str
    """What the benchmark printed (the children's own output aside)."""
    data: dict[str, Any]
    """Its ``--json``."""
    docs: str
    """The ``--docs`` file after the run."""
    plots: Path
    """Its ``--plots`` directory (made by the benchmark)."""


SMALL_QUICK = dataclasses.replace(QUICK, max_prompt_len=256, budget=512)
"""``--quick`` for the CPU runs below: QUICK with prompts of about 48 tokens instead of 774
(the same 12 requests), which is what makes an all-modes run cost 2 s of CPU instead of 11.
What these tests check -- which runs the matrix makes, in what order, their exit codes,
reports, verification, JSON and table -- does not depend on the prompts' length."""


@pytest.fixture(scope="module")
def small_matrix(tmp_path_factory: pytest.TempPathFactory) -> SmallMatrix:
    """One real matrix on the CPU, checked by the two tests below: a warm-up, then 2:1 at
    one stage (every mode) and at two (async), Poisson arrivals, a TTFT SLO, the JSON and a
    docs file whose table it replaces. ``--run-arg`` is given as two arguments
    (``--run-arg=--device --run-arg=cpu``: one option over two, run end to end here); the
    joined form's jobs are checked without running, above and in test_sharing.py."""
    tmp = tmp_path_factory.mktemp("small-matrix")
    report, docs, plots = tmp / "matrix.json", tmp / "benchmarks.md", tmp / "plots" / "new"
    docs.write_text(
        "# head\n<!-- afd bench prefill -->\nold table\n<!-- /afd bench prefill -->\nafter\n"
    )
    argv = [
        "bench", "prefill", "--quick", "--preset", "tiny", "--workload", "uniform",
        "--layout", "2:1", "--stages", "1", "--stages", "2", "--rate", "40",
        "--ttft-slo", "5", "--run-arg=--device", "--run-arg=cpu", "--json", str(report),
        "--docs", str(docs), "--warm-up", "on", "--plots", str(plots),
    ]  # fmt: skip
    from afd_tools.bench import prefill

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(prefill, "QUICK", SMALL_QUICK)
        code = main(argv)
    assert code == 0, printed.getvalue()
    data = json.loads(report.read_text())
    return SmallMatrix(printed.getvalue(), data, docs.read_text(), plots)


@pytest.mark.timeout(600)  # the fixture's run counts against the first test that uses it
def test_a_small_matrix_runs_on_cpu_every_output_verified(small_matrix: SmallMatrix) -> None:
    out, data = small_matrix.out, small_matrix.data
    assert out.index("[warm-up, not timed] afd run") < out.index("[1/2] afd run")
    assert data["size"]["requests"] == QUICK.requests
    assert data["size"]["max_prompt_len"] == SMALL_QUICK.max_prompt_len == 256  # the patch held
    assert data["ttft_slo_s"] == 5.0
    (warm,) = data["warm_up"]  # one preset, one A:F
    assert warm["exit_code"] == 0
    assert "--mode async" in warm["command"]
    assert "--json" not in warm["command"]
    runs = data["runs"]
    assert [(r["stages"], r["modes"], r["rate"]) for r in runs] == [
        (1, list(MODES), 40.0),
        (2, ["async"], 40.0),
    ]
    for run in runs:
        assert run["exit_code"] == 0
        assert run["report"]["verification_failures"] == {}
        assert run["report"]["deployment"]["attention_ranks"] == 2
        for mode in run["modes"]:
            ttft = run["report"]["modes"][mode]["ttft_s"]
            assert len(ttft) == QUICK.requests
            assert all(t > 0 for t in ttft)
    assert "--mode async" in runs[1]["command"]
    assert "--stages 2" in runs[1]["command"]


@pytest.mark.timeout(600)  # the fixture's run counts against the first test that uses it
def test_bench_prefill_runs_every_mode_verified_and_replaces_the_docs_table(
    small_matrix: SmallMatrix,
) -> None:
    text = small_matrix.docs
    assert "old table" not in text
    assert text.startswith(
        "# head\n<!-- afd bench prefill -->\n| preset | workload | A:F | SM shares % | "
        "arrivals | mode |"
    )
    assert text.endswith("<!-- /afd bench prefill -->\nafter\n")
    rows = [line for line in text.splitlines() if line.startswith("| tiny | uniform |")]
    assert [row.split(" | ")[5] for row in rows] == ["async N=1", "sync", "colocated", "async N=2"]
    # the worst error in scientific notation; a run that matches exactly prints 0.0e+00
    assert all(re.search(r"\| yes \(\d\.\de[-+]\d\d\) \|$", row) for row in rows), rows
    runs = small_matrix.data["runs"]
    assert runs[0]["exit_code"] == 0
    assert runs[0]["report"]["verification_failures"] == {}
    assert "--workload-file" in runs[0]["command"]


@pytest.mark.timeout(600)  # the fixture's run counts against the first test that uses it
def test_plots_holds_one_timeline_per_timed_run_and_none_for_the_warm_up(
    small_matrix: SmallMatrix,
) -> None:
    """``--plots DIR`` (made with its parents): each timed run's ``afd run --plot``, named
    by its place in the matrix; the warm-up writes none."""
    names = sorted(path.name for path in small_matrix.plots.iterdir())
    assert names == ["tiny-uniform-2A1F-rate40-n1-run1.png", "tiny-uniform-2A1F-rate40-n2-run1.png"]
    for name in names:
        data = (small_matrix.plots / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert len(data) > 10_000, (name, len(data))  # panels drawn, not an empty canvas
    runs = small_matrix.data["runs"]
    for run, name in zip(runs, names, strict=True):
        assert f"--plot {small_matrix.plots / name}" in run["command"]
    assert "--plot" not in small_matrix.data["warm_up"][0]["command"]


def test_plots_that_names_a_file_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from afd_tools.bench import prefill

    def never(job: RunJob) -> tuple[int, RunReport | None]:
        raise AssertionError("nothing may run")

    monkeypatch.setattr(prefill, "run_in_fresh_process", never)
    taken = tmp_path / "taken.png"
    taken.write_bytes(b"keep")
    argv = [
        "bench", "prefill", "--quick", "--preset", "tiny", "--workload", "uniform",
        "--run-arg=--device=cpu", "--plots", str(taken),
    ]  # fmt: skip
    assert main(argv) == 2
    assert f"--plots {taken} is a file; give a directory" in capsys.readouterr().err
    assert taken.read_bytes() == b"keep"


def test_check_sweeps_is_what_refuses(tmp_path: Path) -> None:
    args = _args("--stages", "2", "--run-arg=--stages=2")  # same value: still two ways
    with pytest.raises(WorkloadError, match="--stages sweeps what --run-arg=--stages sets"):
        check_sweeps(args, point_job(args, "tiny", "uneven", QUICK, tmp_path))


# ---- tools/gpu/main-job: the GPU script's matrix is one this benchmark accepts ----------

MAIN_JOB = Path(__file__).resolve().parents[1] / "gpu" / "main-job"


def _main_job_named_calls() -> list[tuple[str, list[str]]]:
    """Every ``bench NAME ARGS...`` call of the script, in order, as its NAME and its argv
    (arrays expanded; a name that two branches define appears twice)."""
    import re
    import shlex

    text = MAIN_JOB.read_text().replace("\\\n", " ")
    arrays = {
        name: shlex.split(body) for name, body in re.findall(r"^\s*(\w+)=\((.*)\)$", text, re.M)
    }
    calls = []
    for line in re.findall(r"^\s*bench (\S.*)$", text, re.M):
        name, *rest = shlex.split(line)
        words = []
        for word in rest:
            match = re.fullmatch(r"\$\{(\w+)\[@\]\}", word)
            words += arrays[match.group(1)] if match else [word]
        calls.append((name, words))
    return calls


def _main_job_calls() -> list[list[str]]:
    """Every ``bench NAME ARGS...`` call of the script, its arrays expanded, as argv."""
    return [argv for _, argv in _main_job_named_calls()]


def test_every_call_of_the_gpu_main_job_makes_jobs_this_benchmark_accepts(
    tmp_path: Path,
) -> None:
    from afd_tools.run.sharing import gpu_shares
    from afd_transport_nvshmem.mps import VERIFIED_SHARES

    calls = _main_job_calls()
    # Two of the quick size (eager, graph-replayed), fourteen full: v2-lite's depth check,
    # arrivals, least-tokens assignment all at once and under arrivals, and 2A1F with the
    # FFN rank at 50 %, v3-slice's arrivals assigned by pull, its balanced mix at 2A1F and
    # 1A1F, and the long mix's 2A2F and 3A1F as one call with five GPUs or more, as two on
    # fewer (3A1F at 3 layers there).
    assert len(calls) == 16
    split = [argv for name, argv in _main_job_named_calls() if name == "split-v2-lite"]
    assert split == [["--run-arg=--share-gpus", "--preset", "v2-lite", "--workload", "uneven",
                      "--layout", "2:1", "--attention-share", "25", "--stages", "2"]]  # fmt: skip
    balanced = [argv for name, argv in _main_job_named_calls() if name == "balanced-1a1f"]
    assert balanced == [["--preset", "v3-slice", "--workload", "balanced", "--layout", "2:1",
                         "--layout", "1:1", "--stages", "2"]]  # fmt: skip
    three_layers = [argv for argv in calls if "--run-arg=--layers=3" in argv]
    assert len(three_layers) == 1
    assert "3:1" in three_layers[0]
    assert "2:2" not in three_layers[0]
    run_args = ["--run-arg=--device=cuda", "--run-arg=--share-gpus"]
    layouts = set()
    for argv in calls:
        parsed = build_parser().parse_args(["bench", "prefill", *argv, *run_args])
        args = _args(*argv, *run_args)
        size = QUICK if parsed.quick else FULL
        for preset in parsed.preset:
            for workload in parsed.workload:
                base = point_job(args, preset, workload, size, tmp_path)
                check_sweeps(args, base)
                points = expand(args, base, preset, workload)
                assert points
                layouts |= {p.layout for p in points}
                for point in points:
                    job = job_of(base, point)
                    assert job.share_gpus
                    assert job.device == "cuda"
                    # a split the GEMM probe refuses on an H200 would only be failed rows
                    names = [f"attention rank {r}" for r in range(point.attention_ranks)]
                    names += [f"ffn rank {r}" for r in range(point.ffn_ranks)]
                    given = {"attention": job.mps_attention_share, "ffn": job.mps_ffn_share}
                    shares = gpu_shares("cuda:0", names, given)  # afd run's own split
                    assert set(shares.values()) <= set(VERIFIED_SHARES), (argv, shares)
    assert layouts == {"1A1F", "2A1F", "3A1F", "2A2F"}


def test_the_gpu_main_job_explains_itself_and_refuses_an_unknown_argument() -> None:
    import subprocess

    shown = subprocess.run(["bash", str(MAIN_JOB), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0
    assert "tools/gpu/main-job --full" in shown.stdout
    assert "set -uo" not in shown.stdout
    wrong = subprocess.run(["bash", str(MAIN_JOB), "--fast"], capture_output=True, text=True)
    assert wrong.returncode == 2
    assert "unknown argument '--fast' (use --full or nothing)" in wrong.stderr


FULL_NAMES = ("depth-v2-lite arrivals-v2-lite assign-v2-lite arrivals-assign-v2-lite "
              "split-v2-lite target-long-3a1f arrivals arrivals-pull split-2a1f target-long "
              "target-2a1f balanced-1a1f full")  # fmt: skip
"""tools/gpu/main-job --full's benchmarks, in its order, as its messages list them."""


def _main_job_with_probe(
    tmp_path: Path,
    probe: str,
    extra_env: dict[str, str] | None = None,
    args: tuple[str, ...] = ("--full",),
    exit_code: int = 0,
) -> tuple[Any, Path]:
    """``--full`` with a stand-in Python whose GPU probe prints ``probe`` and which records
    each benchmark's arguments and exits with ``exit_code``; the environment holds no
    MAIN_JOB_* setting of the caller."""
    import subprocess

    record = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = "-c" ]; then echo "{probe}"; exit 0; fi\n'
        f'echo "$*" >> {record}\n'
        f"exit {exit_code}\n"
    )
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAIN_JOB_")}
    env |= {"PYTHON": str(fake), "OUT": str(tmp_path / "out")}
    env |= {"MAIN_JOB_WARM_MARKER": str(tmp_path / "warmed")} | (extra_env or {})
    done = subprocess.run(["bash", str(MAIN_JOB), *args], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return done, record


def _run_full_main_job(
    tmp_path: Path, gib: int, gpus: int = 1, env: dict[str, str] | None = None
) -> tuple[str, list[str], list[str]]:
    """``--full`` on ``gpus`` stand-in GPUs of ``gib`` GiB: the script's stdout, the calls
    and the benchmarks' names."""
    done, record = _main_job_with_probe(tmp_path, f"{gpus} {gib}", env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    calls = record.read_text().splitlines()
    names = [re.search(r"--json \S+/([\w-]+)\.json", c).group(1) for c in calls]  # type: ignore[union-attr]
    return done.stdout, calls, names


def test_the_full_main_job_warms_up_once_per_sitting_and_resumes(tmp_path: Path) -> None:
    """The calls run in the documented order, each resumable with a time budget and its
    plots, and only the sitting's first one keeps afd bench prefill's warm-up launch."""
    _, calls, names = _run_full_main_job(tmp_path, 139)
    assert names == FULL_NAMES.split()
    assert "--preset v2-lite --workload uneven --layout 2:1 --stages 2 " in calls[0]
    for call in calls:
        assert call.startswith("-m afd_tools.cli bench prefill ")
        assert "--resume --time-budget " in call
        assert f"--plots {tmp_path}/out/plots" in call
    assert "--warm-up off" not in calls[0]
    assert all("--warm-up off" in c for c in calls[1:])
    assert (tmp_path / "warmed").exists()  # this machine has run one


@pytest.mark.parametrize(
    ("setting", "marked", "first_warms"),
    [("auto", True, False), ("auto", False, True), ("on", True, True), ("off", False, False)],
)
def test_a_sitting_on_a_machine_that_warmed_up_skips_the_warm_up_launch(
    tmp_path: Path, setting: str, marked: bool, first_warms: bool
) -> None:
    """The warm-up launch fills a fresh machine's kernel caches: a later sitting on the same
    machine (the marker an earlier one left) skips it, unless MAIN_JOB_WARM_UP says."""
    if marked:
        (tmp_path / "warmed").touch()
    _, calls, _ = _run_full_main_job(tmp_path, 139, env={"MAIN_JOB_WARM_UP": setting})
    assert ("--warm-up off" not in calls[0]) is first_warms
    assert all("--warm-up off" in c for c in calls[1:])
    assert (tmp_path / "warmed").exists() is (marked or first_warms)


def test_a_failed_warm_up_leaves_no_marker_and_a_bad_setting_is_refused(tmp_path: Path) -> None:
    done, _ = _main_job_with_probe(tmp_path, "1 139", {"MAIN_JOB_WARM_UP": "maybe"})
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "tools/gpu/main-job: MAIN_JOB_WARM_UP=maybe: use auto, on or off"
    )
    failing = tmp_path / "failing"  # every benchmark fails, its warm-up launch too
    failing.mkdir()
    done, _ = _main_job_with_probe(failing, "1 139", {"MAIN_JOB_ONLY": "arrivals"}, exit_code=1)
    assert done.returncode == 1
    assert not (failing / "warmed").exists()


def test_main_job_only_runs_the_named_benchmarks_in_the_scripts_order(tmp_path: Path) -> None:
    """MAIN_JOB_ONLY keeps the named --full benchmarks, in the script's order whatever the
    variable's; each other one is skipped with a line, and its help lists every name."""
    import subprocess

    only = {"MAIN_JOB_ONLY": "split-2a1f\ttarget-long-3a1f \n arrivals"}  # any whitespace
    out, calls, names = _run_full_main_job(tmp_path, 139, env=only)
    assert names == ["target-long-3a1f", "arrivals", "split-2a1f"]
    assert "--warm-up off" not in calls[0]  # the sitting's first run still warms up
    skipped_here = ["depth-v2-lite", "arrivals-v2-lite", "assign-v2-lite",
                    "arrivals-assign-v2-lite", "split-v2-lite", "arrivals-pull", "target-long",
                    "target-2a1f", "balanced-1a1f", "full"]  # fmt: skip
    for skipped in skipped_here:
        assert f"[main-job] {skipped}: not in MAIN_JOB_ONLY, skipped" in out
    (tmp_path / "all").mkdir()
    everything = _run_full_main_job(tmp_path / "all", 139)[2]
    shown = subprocess.run(["bash", str(MAIN_JOB), "--help"], capture_output=True, text=True)
    listed = re.search(r"Names: ([\w\s-]+?)\n\n", shown.stdout + "\n")
    assert listed is not None
    assert listed.group(1).split() == everything


@pytest.mark.parametrize(
    ("only", "args", "message"),
    [
        ("arrivals depth", ("--full",), "MAIN_JOB_ONLY names 'depth', which is no benchmark "
         f"of --full (names: {FULL_NAMES})"),
        ("arrivals", (), "MAIN_JOB_ONLY picks among --full's benchmarks only"),
        (" \t", ("--full",), f"MAIN_JOB_ONLY is set but names no benchmark (names: "
         f"{FULL_NAMES}); unset it to run them all"),
        ("f*", ("--full",), "MAIN_JOB_ONLY names 'f*', which is no benchmark of --full "
         f"(names: {FULL_NAMES})"),
    ],
)  # fmt: skip
def test_main_job_only_refuses_a_name_it_does_not_run(
    tmp_path: Path, only: str, args: tuple[str, ...], message: str
) -> None:
    """An unknown name (a typo would skip everything) or the quick size: exit 2 with what
    to change, before any benchmark runs."""
    done, record = _main_job_with_probe(tmp_path, "1 139", {"MAIN_JOB_ONLY": only}, args)
    assert done.returncode == 2
    assert done.stderr == f"tools/gpu/main-job: {message}\n"
    assert not record.exists()


def test_main_job_only_says_when_a_named_benchmark_did_not_run_here(tmp_path: Path) -> None:
    """On an 80 GB GPU v3-slice's benchmarks are skipped by size: naming one of them runs
    nothing for it, and the script says so and exits 1 instead of reporting success."""
    only = {"MAIN_JOB_ONLY": "arrivals-v2-lite arrivals"}
    done, record = _main_job_with_probe(tmp_path, "1 79", only)
    assert done.returncode == 1
    calls = record.read_text().splitlines()
    assert len(calls) == 1
    assert "--preset v2-lite" in calls[0]
    assert "--rate 4 --rate 2" in calls[0]
    assert ("main job: MAIN_JOB_ONLY names arrivals, which did not run on this machine (see "
            "its line above)") in done.stdout  # fmt: skip
    assert "[main-job] arrivals: v3-slice skipped" in done.stdout


def test_the_full_main_job_skips_v3_slice_by_name_on_a_gpu_too_small_for_it(
    tmp_path: Path,
) -> None:
    """On an 80 GB GPU (79 GiB) v3-slice's FFN rank (94 GiB) cannot fit: each benchmark
    that only runs v3-slice is skipped with a line that says why, and the one that runs
    both presets runs v2-lite alone."""
    out, calls, names = _run_full_main_job(tmp_path, 79)
    assert names == ["depth-v2-lite", "arrivals-v2-lite", "assign-v2-lite",
                     "arrivals-assign-v2-lite", "split-v2-lite", "full"]  # fmt: skip
    assert all("v3-slice" not in call for call in calls)
    assert "--layout 3:1 --layout 2:1 --stages 2 --run-arg=--assign=least-tokens" in calls[2]
    assert "--rate 4 --ttft-slo 2 --run-arg=--assign=least-tokens" in calls[3]
    assert "--preset v2-lite --workload uneven --layout 2:1 --attention-share 25" in calls[4]
    assert "--preset v2-lite --workload uneven --workload uniform" in calls[5]
    v3_only = ["target-long-3a1f", "arrivals", "arrivals-pull", "split-2a1f", "target-long",
               "target-2a1f", "balanced-1a1f"]  # fmt: skip
    for skipped in v3_only:
        line = (f"[main-job] {skipped}: v3-slice skipped: its FFN rank's routed experts "
                "alone are 84 GiB (94 GiB its whole process on an H200) and this GPU has 79 "
                "GiB (MAIN_JOB_V3_GIB=120)")  # fmt: skip
        assert line in out
    assert "[main-job] full: v3-slice skipped" in out


def test_on_several_gpus_the_full_main_job_leaves_the_fit_to_afd_run(tmp_path: Path) -> None:
    """Four 79 GiB GPUs: 2A2F puts 42 GiB of experts on each FFN GPU and fits, so nothing is
    skipped by size (afd run refuses, at once, a placement that cannot fit)."""
    out, calls, names = _run_full_main_job(tmp_path, 79, gpus=4)
    assert "skipped" not in out
    assert "target-long" in names
    assert any("v3-slice" in call for call in calls)


@pytest.mark.parametrize("probe", ["1", "x 80", "", "1 80 extra words"])
def test_a_gpu_probe_that_prints_no_two_counts_is_no_gpu(tmp_path: Path, probe: str) -> None:
    """A probe line that is not two numbers (a torch warning, a half-started driver) is
    read as no GPU: exit 2 with the reason, no benchmark run, no shell error."""
    done, record = _main_job_with_probe(tmp_path, probe)
    assert done.returncode == 2
    assert done.stderr == "tools/gpu/main-job: needs a CUDA GPU\n"
    assert not record.exists()


def test_a_warm_up_precedes_the_first_run_of_each_preset_and_layout(tmp_path: Path) -> None:
    args = _args("--layout", "1:1", "--layout", "2:1", "--stages", "1", "--stages", "2")
    runs = []
    for preset in ("tiny", "v3-mini"):
        base = point_job(args, preset, "uneven", QUICK, tmp_path)
        runs += [(p, job_of(base, p)) for p in expand(args, base, preset, "uneven")]
    plan = warm_up_plan(runs)
    assert sorted(plan) == [0, 2, 4, 6]  # two stage counts per (preset, layout)
    for index, job in plan.items():
        point, timed = runs[index]
        assert (job.preset, job.attention_ranks, job.ffn_ranks) == (
            point.preset,
            point.attention_ranks,
            point.ffn_ranks,
        )
        assert job.modes == ("async",)
        assert job.stages == timed.stages
        assert job.json is None
    cpu = dataclasses.replace(runs[0][1], device="cpu")
    assert not warms_up("auto", cpu)
    assert warms_up("on", cpu)
    assert not warms_up("off", dataclasses.replace(cpu, device="cuda"))
    assert warms_up("auto", dataclasses.replace(cpu, device="cuda"))


def test_a_stopped_benchmark_keeps_the_runs_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from afd_tools.bench import prefill

    calls = []

    def fake_run(job: RunJob) -> tuple[int, RunReport | None]:
        calls.append(job)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second run
        return 1, None  # the first run failed: still recorded

    monkeypatch.setattr(prefill, "run_in_fresh_process", fake_run)
    out = tmp_path / "partial.json"
    argv = [
        "bench", "prefill", "--quick", "--preset", "tiny", "--workload", "uniform",
        "--stages", "1", "--stages", "2", "--warm-up", "off", "--run-arg=--device=cpu",
        "--json", str(out),
    ]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    data = json.loads(out.read_text())
    assert data["complete"] is False
    assert data["planned_runs"] == 2
    assert [(r["stages"], r["exit_code"]) for r in data["runs"]] == [(1, 1)]


def test_a_failed_run_names_its_split_and_modes_and_a_failed_warm_up_fails_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from afd_tools.bench import prefill

    failed = BenchRun(_point(25, 2, ("async",)), "afd run", 2, 0.5, None)
    row = next(line for line in markdown_table([failed]).splitlines() if "failed" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:7] == ["A 25", "all at once", "async N=2", "failed (exit 2)"]

    def fake_run(job: RunJob) -> tuple[int, RunReport | None]:
        return (1, None) if job.modes == ("async",) else (0, None)

    monkeypatch.setattr(prefill, "run_in_fresh_process", fake_run)
    argv = [
        "bench", "prefill", "--quick", "--preset", "tiny", "--workload", "uniform",
        "--warm-up", "on", "--run-arg=--device=cpu",
    ]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "Warm-up failed (exit 1): afd run" in out


@pytest.mark.parametrize("slo", ["0", "-1", "nan", "inf"])
def test_a_ttft_slo_that_is_not_a_finite_positive_time_is_refused(
    slo: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "prefill", "--quick", "--preset", "tiny", "--ttft-slo", slo]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("afd bench prefill: error: --ttft-slo must be a finite number of")


def test_the_kept_h200_state_resumes_the_main_jobs_benchmarks_on_one_141_gb_gpu(
    tmp_path: Path,
) -> None:
    """tools/gpu/main-job-state/h200-141gb holds what one H200 measured of ``--full``: each
    file resumes the script's call of the same name as one GPU of 141 GB makes it (v3-slice
    kept; ``shared`` empty, as on fewer than five GPUs; the 3A1F long mix at 3 layers),
    keeping every run it holds; the same call with v2-lite in its place is refused."""
    from afd_tools.bench.prefill_resume import ResumeError, resumed_runs

    state = MAIN_JOB.parent / "main-job-state" / "h200-141gb"
    one_gpu: dict[str, list[str]] = {}
    for name, argv in _main_job_named_calls():
        one_gpu.setdefault(name, argv)  # the first of two branches is the one-GPU one
    run_args = ["--run-arg=--device=cuda", "--run-arg=--share-gpus"]
    files = sorted(state.glob("*.json"))
    kept = {"target-long-3a1f", "arrivals", "arrivals-pull", "split-2a1f", "target-2a1f",
            "balanced-1a1f"}  # fmt: skip
    assert {f.stem for f in files} == kept
    for path in files:
        argv = [a for a in one_gpu[path.stem] if a != "--run-arg=--share-gpus"]  # "shared"
        parsed = build_parser().parse_args(["bench", "prefill", *argv, *run_args])
        args = _args(*argv, *run_args)

        def plan(presets: list[str], args: Any = args, workloads: Any = parsed.workload) -> Any:
            runs = []
            for preset in presets:
                for workload in workloads:
                    base = point_job(args, preset, workload, FULL, tmp_path)
                    runs += [(p, job_of(base, p)) for p in expand(args, base, preset, workload)]
            return runs

        given = _kept_run_args(argv, run_args)
        data = json.loads(path.read_text())
        resumed = resumed_runs(path, plan(parsed.preset), FULL, parsed.ttft_slo, given, 0)
        assert len(resumed.kept) == len(data["runs"]) > 0, path.name
        with pytest.raises(ResumeError, match="another matrix"):
            resumed_runs(path, plan(["v2-lite"]), FULL, parsed.ttft_slo, given, 0)


def _kept_run_args(argv: list[str], run_args: list[str]) -> list[str]:
    """What ``afd bench prefill`` keeps of a call's ``--run-arg=`` words: the words after
    the prefix, the call's own first, then ``run_args``'s."""
    return [a.removeprefix("--run-arg=") for a in [*argv, *run_args] if "--run-arg=" in a]


def _without_v3_slice(argv: list[str]) -> list[str]:
    """``argv`` less its ``--preset v3-slice`` pair, as main-job calls on an 80 GB GPU."""
    kept: list[str] = []
    for word in argv:
        if kept and kept[-1] == "--preset" and word == "v3-slice":
            kept.pop()
        else:
            kept.append(word)
    return kept


def test_the_kept_h100_state_resumes_the_main_jobs_benchmarks_on_an_80_gb_gpu(
    tmp_path: Path,
) -> None:
    """tools/gpu/main-job-state/h100-80gb holds what an H100 measured of ``--full``: each
    file is a benchmark that the script's call (v3-slice dropped, as on an 80 GB GPU)
    resumes, keeping every run it holds; the H200's call, with v3-slice, is refused."""
    from afd_tools.bench.prefill_resume import ResumeError, resumed_runs

    state = MAIN_JOB.parent / "main-job-state" / "h100-80gb"
    named: dict[str, list[str]] = {}
    for name, argv in _main_job_named_calls():
        named.setdefault(name, argv)
    run_args = ["--run-arg=--device=cuda", "--run-arg=--share-gpus"]
    files = sorted(state.glob("*.json"))
    # measured after the lower-right fix (2026-12-07): assign-v2-lite, arrivals-assign-v2-lite
    # and depth-v2-lite (its rerun); full and arrivals-v2-lite before it (docs/benchmarks.md)
    assert {f.stem for f in files} == {"depth-v2-lite", "arrivals-v2-lite", "full",
                                       "assign-v2-lite", "arrivals-assign-v2-lite"}  # fmt: skip

    def plan(argv: list[str]) -> list[tuple[Point, RunJob]]:
        parsed = build_parser().parse_args(["bench", "prefill", *argv, *run_args])
        args = _args(*argv, *run_args)
        runs = []
        for preset in parsed.preset:
            for workload in parsed.workload:
                base = point_job(args, preset, workload, FULL, tmp_path)
                runs += [(p, job_of(base, p)) for p in expand(args, base, preset, workload)]
        return runs

    for path in files:
        argv = _without_v3_slice(named[path.stem])
        slo = build_parser().parse_args(["bench", "prefill", *argv, *run_args]).ttft_slo
        given = _kept_run_args(argv, run_args)
        held = len(json.loads(path.read_text())["runs"])
        resumed = resumed_runs(path, plan(argv), FULL, slo, given, 0)
        assert len(resumed.kept) == held > 0, path.name
    full, kept = named["full"], _kept_run_args(named["full"], run_args)
    with pytest.raises(ResumeError, match="another matrix"):
        resumed_runs(state / "full.json", plan(full), FULL, None, kept, 0)


def test_main_job_rerun_measures_named_benchmarks_again_and_resumes_the_rest(
    tmp_path: Path,
) -> None:
    """MAIN_JOB_RERUN: the named benchmark's kept results are not copied from MAIN_JOB_FROM
    (so afd bench prefill --resume starts it afresh), with a line saying so; the others
    are copied and resumed as before."""
    kept = tmp_path / "kept"
    kept.mkdir()
    for name in ("depth-v2-lite", "arrivals-v2-lite"):
        (kept / f"{name}.json").write_text('{"runs": []}')
    env = {"MAIN_JOB_FROM": str(kept), "MAIN_JOB_RERUN": "arrivals-v2-lite",
           "MAIN_JOB_ONLY": "depth-v2-lite arrivals-v2-lite"}  # fmt: skip
    done, record = _main_job_with_probe(tmp_path, "1 79", env)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert (out / "depth-v2-lite.json").read_text() == '{"runs": []}'
    assert not (out / "arrivals-v2-lite.json").exists()
    assert (f"[main-job] arrivals-v2-lite: MAIN_JOB_RERUN, measured again (not resumed from "
            f"{kept}/arrivals-v2-lite.json)") in done.stdout  # fmt: skip
    calls = record.read_text().splitlines()
    assert [re.search(r"--json \S+/([\w-]+)\.json", c).group(1) for c in calls] == [  # type: ignore[union-attr]
        "depth-v2-lite",
        "arrivals-v2-lite",
    ]
    assert all("--resume" in call for call in calls)


@pytest.mark.parametrize(
    ("env", "held", "message"),
    [
        ({"MAIN_JOB_RERUN": "arrivals-v2-lite"}, False,
         "MAIN_JOB_RERUN leaves results out of MAIN_JOB_FROM's; without MAIN_JOB_FROM every "
         "benchmark starts afresh: drop MAIN_JOB_RERUN"),
        ({"MAIN_JOB_RERUN": "arrivals-v2", "MAIN_JOB_FROM": "KEPT"}, False,
         f"MAIN_JOB_RERUN names 'arrivals-v2', which is no benchmark of --full (names: "
         f"{FULL_NAMES})"),
        ({"MAIN_JOB_RERUN": "arrivals-v2-lite", "MAIN_JOB_FROM": "KEPT",
          "MAIN_JOB_ONLY": "depth-v2-lite"}, False,
         "MAIN_JOB_RERUN names 'arrivals-v2-lite', which MAIN_JOB_ONLY does not: it would be "
         "neither resumed nor measured (its results missing from OUT); add it to MAIN_JOB_ONLY "
         "or drop it from MAIN_JOB_RERUN"),
        ({"MAIN_JOB_RERUN": "arrivals-v2-lite", "MAIN_JOB_FROM": "KEPT"}, True,
         "MAIN_JOB_RERUN names 'arrivals-v2-lite', but OUT/arrivals-v2-lite.json is already "
         "there and would be resumed: give an OUT without it"),
    ],
)  # fmt: skip
def test_main_job_rerun_refuses_what_it_cannot_do(
    tmp_path: Path, env: dict[str, str], held: bool, message: str
) -> None:
    """Without MAIN_JOB_FROM, with a name that is no benchmark or that MAIN_JOB_ONLY leaves
    out (neither resumed nor measured), or where OUT already holds the benchmark's results
    (they would be resumed): exit 2 with what to change, before any benchmark runs."""
    kept = tmp_path / "kept"
    kept.mkdir()
    out = tmp_path / "out"
    if held:
        out.mkdir()
        (out / "arrivals-v2-lite.json").write_text('{"runs": []}')
    env = {k: v.replace("KEPT", str(kept)) for k, v in env.items()}
    done, record = _main_job_with_probe(tmp_path, "1 79", env)
    assert done.returncode == 2
    assert done.stderr == f"tools/gpu/main-job: {message.replace('OUT/', f'{out}/')}\n"
    assert not record.exists()
