"""``afd run``'s job as an object: :class:`RunJob` refuses what cannot run, naming the
option; the command line builds the same job as the code does; and ``run_job(job)``
returns the report that ``afd run --json`` writes."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from afd_tools.cli import build_parser, main
from afd_tools.outputs import json_safe
from afd_tools.prefill.run_report import SCHEMA, RunReport
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.api import run_job
from afd_tools.run.command import job_from_args
from afd_tools.run.job import MODES, RunJob
from afd_tools.run.plan import prepare


def _parsed(*argv: str) -> Any:
    return build_parser().parse_args(["run", *argv])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stages": 0}, "--stages must be >= 1, got 0"),
        ({"attention_ranks": 0}, "--attention-ranks and --ffn-ranks must be >= 1"),
        ({"ffn_ranks": -1}, "--attention-ranks and --ffn-ranks must be >= 1"),
        ({"layers": 0}, "--layers must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be >= 1, got 0"),
        ({"tie_margin": 1.5}, "--tie-margin must be within [0, 1], got 1.5"),
        ({"tie_margin": float("nan")}, "--tie-margin must be within [0, 1], got nan"),
        ({"tie_margin_from": "both"}, "--tie-margin-from must be one of depth, drift, got 'both'"),
        ({"timeout": 0.0}, "--timeout must be > 0 seconds, got 0.0"),
        ({"run_timeout": -1.0}, "--run-timeout must be > 0 seconds, got -1.0"),
        ({"preset": "gpt-5"}, "--preset gpt-5: choose one of "),
        ({"device": "tpu"}, "--device tpu: choose one of auto, cpu, cuda"),
        ({"dtype": "float16"}, "--dtype float16: choose one of bfloat16, float32"),
        ({"colocated": "ep"}, "--colocated ep: choose one of dp, dp-ep, mono"),
        ({"workload": "huge"}, "--workload huge: choose one of "),
        ({"assign": "random"}, "--assign random: choose one of "),
        ({"shared": "both"}, "--shared both: choose one of "),
        ({"wire_format": "v3"}, "--wire-format v3: choose one of "),
        ({"modes": ()}, "--mode : choose from async, sync, colocated"),
        ({"modes": ("async", "fast")}, "--mode async,fast: choose from async, sync, colocated"),
        ({"modes": ("sync", "sync")}, "--mode sync,sync: each mode once"),
        ({"warm_pass": "maybe"}, "--warm-pass maybe: choose one of auto, on, off"),
        ({"min_stage_tokens": -5}, "--min-stage-tokens must be >= 0 (0: always --stages)"),
        ({"ffn_graph_buckets": ()}, "--ffn-graph-buckets (): row counts >= 1, e.g. 1024,8192"),
        ({"ffn_graph_buckets": (0, 8)}, "--ffn-graph-buckets (0, 8): row counts >= 1"),
        (
            {"ffn_graph": True, "ffn_graph_buckets": (64,)},
            "--ffn-graph already replays the experts inside the serve loop's graph; drop "
            "--ffn-graph-buckets",
        ),
        (
            {"wire_format": "per_choice"},
            "--combine-reduce ffn needs --wire-format per_rank (per_choice rows carry no "
            "weights for the FFN ranks to reduce with); add --combine-reduce attention",
        ),
    ],
)
def test_a_job_that_cannot_run_is_refused_naming_the_option(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(WorkloadError) as caught:
        RunJob(**change)
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_warm_pass_is_on_for_cuda_ranks_unless_asked_otherwise() -> None:
    assert RunJob().warms_whole_workload("cuda:0")
    assert not RunJob().warms_whole_workload("cpu")
    assert RunJob(warm_pass="on").warms_whole_workload("cpu")
    assert not RunJob(warm_pass="off").warms_whole_workload("cuda:1")


def test_a_job_is_frozen_and_a_changed_copy_is_checked_again() -> None:
    job = RunJob()
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.stages = 2  # type: ignore[misc]
    with pytest.raises(WorkloadError, match="--stages must be >= 1"):
        dataclasses.replace(job, stages=0)


def test_the_command_line_defaults_are_the_jobs() -> None:
    assert job_from_args(_parsed()) == RunJob()


def test_the_command_line_builds_the_job_field_by_field() -> None:
    args = _parsed(
        "--device", "cpu", "--attention-ranks", "3", "--ffn-ranks", "1", "--mode", "sync",
        "--workload-file", "w.jsonl", "--rate", "12.5", "--stages", "2", "--shared", "ffn",
        "--wire-format", "per_choice", "--combine-reduce", "attention", "--tie-margin", "0.5",
        "--tie-margin-from", "drift", "--json", "out.json", "--no-progress",
    )  # fmt: skip
    job = job_from_args(args)
    assert job == RunJob(
        device="cpu",
        attention_ranks=3,
        ffn_ranks=1,
        modes=("sync",),
        workload_file=Path("w.jsonl"),
        rate=12.5,
        stages=2,
        shared="ffn",
        wire_format="per_choice",
        combine_reduce="attention",
        tie_margin=0.5,
        tie_margin_from="drift",
        json=Path("out.json"),
        no_progress=True,
    )
    # what the report keeps of it: every option as a string, as the namespace holds them
    namespace = {k: str(v) for k, v in vars(args).items() if k != "handler"}
    assert job.as_args() == namespace
    assert list(job.as_args()) == list(namespace)


@pytest.mark.parametrize(
    "job",
    [
        RunJob(),
        RunJob(device="cpu", modes=("async",), rate=3.0, share_gpus=True, layers=2),
        RunJob(workload_file=Path("/tmp/a b.jsonl"), dtype="bfloat16", colocated="mono"),
        RunJob(backend="triton", ffn_graph_buckets=(64, 4096)),
        RunJob(device="cuda", transport="nvshmem", exchange_graphs=4),
        RunJob(device="cuda", transport="nvshmem", backend="triton", ffn_graph=True),
    ],
)
def test_the_command_line_of_a_job_builds_that_job(job: RunJob) -> None:
    words = shlex.split(job.command_line())
    assert words[:2] == ["afd", "run"]
    assert job_from_args(_parsed(*words[2:])) == job


def test_a_job_is_resolved_for_the_device_when_it_is_planned() -> None:
    job = RunJob(device="cpu", requests=4, max_prompt_len=16)
    with pytest.raises(ValueError, match=r"RunJob\.dtype is not resolved yet"):
        job.deployment("cpu")
    plan = prepare(job)
    assert (plan.job.dtype, plan.job.backend, plan.job.transport, plan.job.colocated) == (
        "float32",
        "reference",
        "shm",
        "dp",
    )
    assert plan.job.device == "cpu"
    assert plan.modes == MODES
    assert len(plan.requests) == 4
    deployment = plan.job.deployment(plan.placement.kind)
    assert (deployment.device, deployment.dtype, deployment.max_num_batched_tokens) == (
        "cpu",
        "float32",
        256,
    )


TINY = ["--device", "cpu", "--attention-ranks", "1", "--ffn-ranks", "1", "--mode", "async"]
TINY += ["--requests", "4", "--max-prompt-len", "24", "--max-num-batched-tokens", "32"]


def test_run_job_returns_the_report_afd_run_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The library call prints nothing and returns the typed report; ``afd run --json``
    on the same options writes that report (the timings aside, which differ run to run)."""
    path = tmp_path / "run.json"
    argv = [*TINY, "--no-progress", "--json", str(path)]
    report = run_job(job_from_args(_parsed(*argv)))
    assert capsys.readouterr().out == ""
    assert isinstance(report, RunReport)
    assert not path.exists()  # writing is the command's business
    assert report.verification["verification_failures"] == {}
    assert set(report.modes) == {"async"}
    assert report.modes["async"].tokens_per_s > 0

    assert main(["run", *argv]) == 0
    written = json.loads(path.read_text())
    assert written["schema"] == SCHEMA
    mine = json.loads(json.dumps(json_safe(report.to_json())))
    for key in ("deployment", "requests", "placement", "args", "verification_failures"):
        assert mine[key] == written[key], key
    assert set(mine) == set(written)
    assert set(mine["modes"]["async"]) == set(written["modes"]["async"])
    assert RunReport.from_json(written, str(path)).deployment == report.deployment


def test_bench_prefill_refuses_a_run_arg_that_makes_no_job_before_running_any(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "prefill", "--quick", "--run-arg=--stages=0"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "afd bench prefill: error: --stages must be >= 1, got 0"
    assert "[1/" not in captured.out  # no run started


def test_a_job_run_in_a_fresh_process_answers_its_exit_code_and_report(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The benchmark's isolation: the child refuses the job as ``afd run`` would (exit 2,
    the one-line error, no report), and the parent gets that answer back."""
    from afd_tools.bench.prefill import run_in_fresh_process

    assert run_in_fresh_process(RunJob(device="cpu", transport="nvshmem")) == (2, None)
    assert "afd run: error: --transport nvshmem needs --device cuda" in capfd.readouterr().err


def test_ffn_graph_buckets_need_the_triton_backend_and_whole_row_counts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(WorkloadError) as caught:
        prepare(RunJob(device="cpu", requests=4, max_prompt_len=16, ffn_graph_buckets=(64,)))
    assert str(caught.value) == (
        "--ffn-graph-buckets replays the triton backend's kernels, but the FFN ranks' backend "
        "is reference: add --backend triton"
    )
    with pytest.raises(WorkloadError) as caught:
        prepare(RunJob(device="cpu", requests=4, max_prompt_len=16, ffn_graph=True))
    assert str(caught.value) == (
        "--ffn-graph replays the triton backend's kernels, but the FFN ranks' backend is "
        "reference: add --backend triton"
    )
    with pytest.raises(WorkloadError) as caught:
        prepare(RunJob(device="cpu", backend="triton", shared="ffn", ffn_graph=True))
    assert str(caught.value) == (
        "--ffn-graph serves routed experts only: use --shared attention (the default)"
    )
    with pytest.raises(SystemExit):
        _parsed("--ffn-graph-buckets", "64,x")
    assert "'64,x': comma-separated row counts >= 1, e.g. 1024,8192" in capsys.readouterr().err


FAST_PATH = Path(__file__).resolve().parents[1] / "gpu" / "fast-path"


def test_every_variant_of_the_gpu_fast_path_script_is_a_valid_afd_run() -> None:
    """tools/gpu/fast-path's afd run command lines (its base array and each variant's
    extra options) parse into jobs afd run accepts, so a renamed option fails here, not on a
    GPU."""
    import re

    text = FAST_PATH.read_text().replace("\\\n", " ")
    base = shlex.split(re.search(r"^base=\((.*?)\)$", text, re.M | re.S).group(1))  # type: ignore[union-attr]
    base = [w for w in base if w != '"${share[@]}"' and w != "${share[@]}"] + ["--share-gpus"]
    variants = dict(re.findall(r"^\s*([\w-]+)\) extra=\((.*)\) ;;$", text, re.M))
    assert set(variants) == {"eager", "graphs", "both", "graphs-floor", "both-floor"}
    jobs = {v: job_from_args(_parsed(*base, *shlex.split(extra))) for v, extra in variants.items()}
    assert jobs["both"].ffn_graph
    assert jobs["both"].exchange_graphs == jobs["graphs"].exchange_graphs == 8
    assert not jobs["eager"].ffn_graph
    assert not jobs["eager"].exchange_graphs
    assert {j.backend for j in jobs.values()} == {"triton"}
    for plain in ("graphs", "both"):
        floored = jobs[f"{plain}-floor"]
        assert floored.min_stage_tokens == 2048
        assert dataclasses.replace(floored, min_stage_tokens=0) == jobs[plain]


def test_the_gpu_fast_path_script_refuses_an_unknown_variant() -> None:
    import subprocess

    wrong = subprocess.run(["bash", str(FAST_PATH), "fastest"], capture_output=True, text=True)
    assert wrong.returncode == 2
    expected = "unknown variant 'fastest' (eager, graphs, both, graphs-floor or both-floor)"
    assert expected in wrong.stderr
