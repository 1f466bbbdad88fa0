"""``afd run`` with ranks sharing a GPU, decided on the CPU: the placement and colocated
baseline, each rank's CUDA MPS share and the refusals (word for word), the MPS daemon's
lifetime against the stand-in control program (stopped after a normal end, an exception,
Ctrl-C and SIGTERM; no process or directory left), the wiring of the shares into the rank
specs, and the monolithic baseline end to end on the CPU."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from afd_protocol import Role
from afd_protocol.launch import RankSpec, shm_transport
from afd_tools.cli import main
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run import launches, sharing
from afd_tools.run.devices import place
from afd_tools.run.sharing import (
    afd_shares,
    check_mps_options,
    close_undisturbed,
    describe_sharing,
    mps_clients,
)
from afd_transport_nvshmem.mps import MpsDaemon
from afd_transport_nvshmem.mps_stand_in import (
    daemon_processes,
    environment_without_mps,
    write_stand_in,
)

ONE_GPU_2A1F = place("cuda", 2, 1, share_gpus=True, gpus=1)
SMALL = [
    "run",
    "--device",
    "cpu",
    "--requests",
    "8",
    "--max-prompt-len",
    "48",
    "--max-num-batched-tokens",
    "64",
    "--no-progress",
]


# placement and the colocated baseline ----------------------------------------------------
def test_one_gpu_places_every_rank_there_and_the_baseline_is_the_monolithic_model() -> None:
    p = ONE_GPU_2A1F
    assert (p.attention, p.ffn, p.shared) == (("cuda:0", "cuda:0"), ("cuda:0",), True)
    assert p.colocated_mode == "mono"
    assert p.colocated == ("cuda:0",)
    assert p.colocated_label == "monolithic model on one GPU (DP1, EP1)"
    assert p.exchange == "none"
    assert p.gpu_ranks() == {"cuda:0": ["attention rank 0", "attention rank 1", "ffn rank 0"]}
    # dp-ep on one GPU is DP1+EP1: the monolithic model, not colocated ranks over gloo
    assert place("cuda", 1, 1, share_gpus=True, colocated="dp-ep", gpus=1).colocated_mode == "mono"


def test_shared_gpus_give_colocated_dp_ep_one_rank_per_gpu_over_nccl() -> None:
    p = place("cuda", 2, 1, share_gpus=True, gpus=2)
    assert (p.attention, p.ffn) == (("cuda:0", "cuda:1"), ("cuda:0",))
    assert p.colocated_mode == "dp-ep"
    assert p.colocated == ("cuda:0", "cuda:1")
    assert p.colocated_label == "DP2+EP over nccl"
    unshared = place("cuda", 1, 1, share_gpus=False, gpus=2)
    assert (unshared.shared, unshared.colocated_mode, unshared.colocated) == (
        False,
        "dp-ep",
        ("cuda:0", "cuda:1"),
    )
    cpu = place("cpu", 2, 2, share_gpus=False)
    assert (cpu.colocated_mode, cpu.exchange, cpu.gpu_ranks()) == ("dp", "none", {})
    assert place("cpu", 2, 2, False, "dp-ep").colocated_label == "DP4+EP over gloo"
    assert place("cpu", 2, 2, False, "mono").colocated_label == (
        "monolithic model in one process (DP1, EP1)"
    )


def test_more_ranks_than_gpus_without_share_gpus_says_what_to_add() -> None:
    with pytest.raises(WorkloadError) as caught:
        place("cuda", 1, 1, share_gpus=False, gpus=1)
    assert str(caught.value) == (
        "--device cuda runs one process per GPU: 1 attention + 1 FFN ranks need 2 GPUs, but 1 "
        "are visible; use fewer ranks, or add --share-gpus to place several ranks per GPU "
        "under CUDA MPS (then one GPU's timings include the sharing, and rows cross HBM "
        "instead of NVLink)"
    )


# shares ----------------------------------------------------------------------------------
def test_by_default_each_gpu_is_split_equally_among_its_ranks() -> None:
    # three ranks: 25 % each, the largest verified share that fits (33 % gave NaN in bf16)
    assert afd_shares(ONE_GPU_2A1F, None, None) == {
        "attention rank 0": 25,
        "attention rank 1": 25,
        "ffn rank 0": 25,
    }
    two = place("cuda", 2, 1, share_gpus=True, gpus=2)  # cuda:0 attention 0 + ffn 0
    assert afd_shares(two, None, None) == {
        "attention rank 0": 50,
        "ffn rank 0": 50,
        "attention rank 1": 100,
    }
    assert afd_shares(place("cuda", 1, 1, share_gpus=False, gpus=2), None, None) == {}
    assert afd_shares(place("cpu", 2, 2, False), 50, 50) == {}


def test_a_given_share_is_each_rank_of_that_role_and_the_others_split_the_rest() -> None:
    assert afd_shares(ONE_GPU_2A1F, None, 50) == {
        "attention rank 0": 25,
        "attention rank 1": 25,
        "ffn rank 0": 50,
    }
    assert afd_shares(ONE_GPU_2A1F, 40, None) == {
        "attention rank 0": 40,
        "attention rank 1": 40,
        "ffn rank 0": 20,
    }
    assert afd_shares(ONE_GPU_2A1F, 30, 40) == {
        "attention rank 0": 30,
        "attention rank 1": 30,
        "ffn rank 0": 40,
    }


@pytest.mark.parametrize(
    ("attention", "ffn", "message"),
    [
        (
            40,
            40,
            "cuda:0 holds attention rank 0, attention rank 1 and ffn rank 0 with CUDA MPS shares "
            "40 + 40 + 40 = 120 %: the ranks of one GPU may add up to at most 100 % (above it "
            "NVSHMEM's synchronising calls may deadlock); lower --mps-attention-share or "
            "--mps-ffn-share",
        ),
        (
            60,
            None,
            "cuda:0: with attention rank 0 at 60 % and attention rank 1 at 60 %, 0 % of the GPU "
            "is left for ffn rank 0 (each needs at least 1 %); lower --mps-attention-share",
        ),
        (
            None,
            100,
            "cuda:0: with ffn rank 0 at 100 %, 0 % of the GPU is left for attention rank 0 and "
            "attention rank 1 (each needs at least 1 %); lower --mps-ffn-share",
        ),
        (
            0,
            None,
            "--mps-attention-share 0: a CUDA MPS share is 1 to 100 (percent of a GPU's SMs); "
            "give a value in that range",
        ),
        (
            None,
            101,
            "--mps-ffn-share 101: a CUDA MPS share is 1 to 100 (percent of a GPU's SMs); give a "
            "value in that range",
        ),
    ],
)
def test_shares_that_do_not_fit_name_the_gpu_the_ranks_and_the_numbers(
    attention: int | None, ffn: int | None, message: str
) -> None:
    with pytest.raises(WorkloadError) as caught:
        afd_shares(ONE_GPU_2A1F, attention, ffn)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("placement", "attention", "ffn", "no_mps", "transport", "message"),
    [
        (
            place("cpu", 1, 1, False),
            50,
            None,
            False,
            "shm",
            "--mps-attention-share applies only to ranks sharing a GPU (--device cuda "
            "--share-gpus with more ranks than GPUs), but on the CPU: drop --mps-attention-share",
        ),
        (
            place("cuda", 1, 1, share_gpus=True, gpus=2),
            None,
            None,
            True,
            "shm",
            "--no-mps applies only to ranks sharing a GPU (--device cuda --share-gpus with more "
            "ranks than GPUs), but here every rank has its own GPU: drop --no-mps",
        ),
        (
            ONE_GPU_2A1F,
            None,
            50,
            True,
            "shm",
            "--no-mps runs the shared GPUs without CUDA MPS, so there is no share to set: drop "
            "--mps-ffn-share or --no-mps",
        ),
        (
            ONE_GPU_2A1F,
            None,
            None,
            True,
            "nvshmem",
            "--no-mps: the nvshmem transport refuses ranks sharing a GPU outside CUDA MPS (its "
            "barriers and signal waits would abort); add --transport shm or drop --no-mps",
        ),
    ],
)
def test_mps_options_are_refused_where_they_mean_nothing(
    placement: Any,
    attention: int | None,
    ffn: int | None,
    no_mps: bool,
    transport: str,
    message: str,
) -> None:
    with pytest.raises(WorkloadError) as caught:
        check_mps_options(placement, attention, ffn, no_mps, transport)
    assert str(caught.value) == message


def test_mps_options_are_accepted_with_shared_gpus() -> None:
    check_mps_options(ONE_GPU_2A1F, 30, 40, False, "nvshmem")
    check_mps_options(ONE_GPU_2A1F, None, None, True, "shm")
    check_mps_options(place("cpu", 1, 1, False), None, None, False, "shm")


def test_the_report_says_which_rank_had_which_share_of_which_gpu() -> None:
    two = place("cuda", 2, 1, share_gpus=True, gpus=2)
    assert describe_sharing(two, afd_shares(two, None, None)) == (
        "GPUs shared under CUDA MPS: cuda:0 attention rank 0 50 %, ffn rank 0 50 %; cuda:1 "
        "attention rank 1 100 %"
    )
    assert describe_sharing(ONE_GPU_2A1F, {}) == "GPUs shared without CUDA MPS"
    assert describe_sharing(place("cpu", 1, 1, False), {}) == ""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--mps-ffn-share", "50"],
            "--mps-ffn-share applies only to ranks sharing a GPU (--device cuda --share-gpus "
            "with more ranks than GPUs), but on the CPU: drop --mps-ffn-share",
        ),
        (
            ["--no-mps"],
            "--no-mps applies only to ranks sharing a GPU (--device cuda --share-gpus with more "
            "ranks than GPUs), but on the CPU: drop --no-mps",
        ),
    ],
)
def test_afd_run_refuses_mps_options_on_the_cpu_in_one_line_before_anything_runs(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*SMALL, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"afd run: error: {message}"]
    assert "afd run: 2 attention" not in captured.out


# the daemon's lifetime -------------------------------------------------------------------
@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[tuple[Callable[[], MpsDaemon], list[MpsDaemon]]]:
    """A start function over the stand-in control program (never a daemon of the machine),
    and every daemon it started; after the test, none of them has a process or a
    directory left."""
    control = write_stand_in(tmp_path / "bin")
    started: list[MpsDaemon] = []

    def start() -> MpsDaemon:
        daemon = MpsDaemon.start(control=control, environ=environment_without_mps(), timeout=10)
        started.append(daemon)
        return daemon

    yield start, started
    for daemon in started:
        assert daemon.owned
        assert _nothing_left(daemon), daemon


def _nothing_left(daemon: MpsDaemon) -> bool:
    """The daemon's processes exited (bounded wait) and its temporary directory is gone."""
    deadline = time.monotonic() + 10
    while daemon_processes(daemon.pipe_directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.scratch is not None
    return not daemon_processes(daemon.pipe_directory) and not Path(daemon.scratch).exists()


SHARES = {"attention rank 0": 50, "ffn rank 0": 50}


def test_each_rank_gets_its_client_environment_and_the_daemon_stops_after_the_block(
    stand_in: tuple[Callable[[], MpsDaemon], list[MpsDaemon]],
) -> None:
    start, started = stand_in
    with mps_clients(SHARES, start) as environments:
        (daemon,) = started
        assert len(daemon_processes(daemon.pipe_directory)) == 1  # running meanwhile
        assert environments == {
            name: {
                "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_directory,
                "CUDA_MPS_LOG_DIRECTORY": daemon.log_directory,
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
            }
            for name in SHARES
        }
    assert daemon.closed
    assert _nothing_left(daemon)


def test_no_shares_start_no_daemon() -> None:
    def start() -> MpsDaemon:
        raise AssertionError("no daemon may start without shared GPUs")

    with mps_clients({}, start) as environments:
        assert environments == {}


@pytest.mark.parametrize("raised", [RuntimeError("a rank failed"), KeyboardInterrupt()])
def test_the_daemon_stops_when_the_launch_fails_or_is_interrupted(
    stand_in: tuple[Callable[[], MpsDaemon], list[MpsDaemon]], raised: BaseException
) -> None:
    start, started = stand_in
    with pytest.raises(type(raised)), mps_clients(SHARES, start):
        raise raised
    (daemon,) = started
    assert _nothing_left(daemon)


def _terminate_self() -> None:
    """SIGTERM to this process, then a wait it must not reach the end of."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # interrupted long before
    raise AssertionError("SIGTERM did not interrupt")


def test_sigterm_during_the_block_unwinds_like_ctrl_c_and_stops_the_daemon(
    stand_in: tuple[Callable[[], MpsDaemon], list[MpsDaemon]],
) -> None:
    start, started = stand_in
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), mps_clients(SHARES, start):
        _terminate_self()
    (daemon,) = started
    assert _nothing_left(daemon)
    assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_a_daemon_that_cannot_start_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    control = write_stand_in(tmp_path / "bin")
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(**kwargs: Any) -> str:
        made.append(real_mkdtemp(**kwargs))
        return made[-1]

    monkeypatch.setattr("afd_transport_nvshmem.mps.tempfile.mkdtemp", recording_mkdtemp)
    env = {**environment_without_mps(), "FAKE_MPS_FAIL": "1"}
    with (
        pytest.raises(WorkloadError) as caught,
        mps_clients(SHARES, lambda: MpsDaemon.start(control=control, environ=env, timeout=5)),
    ):
        raise AssertionError("not reached")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"ranks share a GPU, which needs CUDA MPS: {control} -d exited with 1: An instance of "
        f"this daemon is already running; "
    )
    assert message.endswith(" (or add --no-mps with --transport shm)")
    assert len(made) == 1
    assert not Path(made[0]).exists()


class _SlowDaemon:
    """A daemon whose close is interrupted by Ctrl-C halfway (a second, impatient one)."""

    def __init__(self) -> None:
        self.finished = False

    def close(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # a KeyboardInterrupt here would leave the daemon running
        self.finished = True


def test_ctrl_c_during_the_stop_waits_for_the_stop_to_finish() -> None:
    daemon = _SlowDaemon()
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        close_undisturbed(daemon)  # type: ignore[arg-type]
    assert daemon.finished
    assert signal.getsignal(signal.SIGINT) is before


# the wiring into afd run's launches ---------------------------------------------------------
def _spec(role: Role, rank: int) -> RankSpec:
    return RankSpec(role, rank, print, env={"KEPT": "1"})


def _group(shares: dict[str, int]) -> Any:
    return launches.Launch(
        ["async"],
        [],
        None,
        [_spec(Role.ATTENTION, 0), _spec(Role.FFN, 0)],
        shm_transport,
        1,
        1,
        [],
        shares,
    )


class _Result:
    def __init__(self, value: Any) -> None:
        self.value = value


@pytest.mark.parametrize("fails", [False, True])
def test_a_launch_gets_its_ranks_mps_environments_and_the_daemon_ends_with_it(
    stand_in: tuple[Callable[[], MpsDaemon], list[MpsDaemon]],
    monkeypatch: pytest.MonkeyPatch,
    fails: bool,
) -> None:
    start, started = stand_in
    monkeypatch.setattr(sharing, "start_daemon", start)
    seen: list[dict[str, dict[str, str]]] = []

    def fake_launch(
        window: Any, specs: list[RankSpec], timeout: Any, factory: Any, start_method: str
    ) -> Any:
        assert start_method == "forkserver"  # the launch's own (_group makes no GPU plan)
        (daemon,) = started
        assert daemon_processes(daemon.pipe_directory)  # alive while the ranks run
        seen.append({s.name: dict(s.env) for s in specs})
        if fails:
            raise KeyboardInterrupt
        return {
            "attention rank 0": _Result({"async": None}),
            "ffn rank 0": _Result({"intervals": []}),
        }

    monkeypatch.setattr(launches, "_launch", fake_launch)
    if fails:
        with pytest.raises(KeyboardInterrupt):
            _group({"attention rank 0": 30, "ffn rank 0": 70}).run(60.0)
    else:
        _group({"attention rank 0": 30, "ffn rank 0": 70}).run(60.0)
    (daemon,) = started
    assert seen == [
        {
            "attention rank 0": {
                "KEPT": "1",
                "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_directory,
                "CUDA_MPS_LOG_DIRECTORY": daemon.log_directory,
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
            },
            "ffn rank 0": {
                "KEPT": "1",
                "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_directory,
                "CUDA_MPS_LOG_DIRECTORY": daemon.log_directory,
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70",
            },
        }
    ]
    assert _nothing_left(daemon)


def test_a_launch_without_shared_gpus_starts_no_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_daemon() -> MpsDaemon:
        raise AssertionError("no daemon may start without shared GPUs")

    monkeypatch.setattr(sharing, "start_daemon", no_daemon)
    seen: list[dict[str, dict[str, str]]] = []

    def fake_launch(
        window: Any, specs: list[RankSpec], timeout: Any, factory: Any, start_method: str
    ) -> Any:
        seen.append({s.name: dict(s.env) for s in specs})
        return {
            "attention rank 0": _Result({"async": None}),
            "ffn rank 0": _Result({"intervals": []}),
        }

    monkeypatch.setattr(launches, "_launch", fake_launch)
    _group({}).run(60.0)
    assert seen == [{"attention rank 0": {"KEPT": "1"}, "ffn rank 0": {"KEPT": "1"}}]


# the monolithic baseline, end to end on the CPU ----------------------------------------------
def test_colocated_mono_runs_every_request_in_one_process_and_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "mono.json"
    argv = [*SMALL, "--colocated", "mono", "--rate", "200", "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "; colocated: monolithic model in one process (DP1, EP1)" in out
    assert "PASS: every request's final hidden state matches" in out
    data = json.loads(report.read_text())
    assert data["verification_failures"] == {}
    assert set(data["verification_worst"]) == {"async", "sync", "colocated"}
    colocated = data["modes"]["colocated"]
    assert len(colocated["attention_busy"]) == 1  # one process did everything
    assert colocated["ffn_busy"] == []
    placement = data["placement"]
    assert placement["colocated_mode"] == "mono"
    assert placement["colocated"] == ["cpu"]
    assert placement["colocated_label"] == "colocated: monolithic model in one process (DP1, EP1)"
    assert placement["sharing"] == "none"
    assert placement["mps_shares"] == {}
    assert set(placement["hardware"]) == {"cpu", "cores", "python", "torch"}  # what it ran on
    assert data["args"]["colocated"] == "mono"


# afd bench prefill -----------------------------------------------------------------------
def test_bench_prefill_passes_the_mps_options_to_every_afd_run(tmp_path: Path) -> None:
    from afd_tools.bench.prefill import sweeps_of
    from afd_tools.bench.prefill_matrix import QUICK, point_job
    from afd_tools.cli import build_parser

    parser = build_parser()
    bench = parser.parse_args(
        [
            "bench",
            "prefill",
            "--run-arg=--share-gpus",
            "--run-arg=--mps-ffn-share=60",
            "--run-arg=--mps-attention-share",
            "--run-arg=40",
            "--run-arg=--no-mps",
        ]
    )
    job = point_job(sweeps_of(bench), "tiny", "uneven", QUICK, tmp_path)
    assert (job.share_gpus, job.mps_ffn_share, job.mps_attention_share, job.no_mps) == (
        True,
        60,
        40,
        True,
    )
    assert (job.preset, job.attention_ranks, job.ffn_ranks, job.stages) == ("tiny", 1, 1, 2)
    assert job.max_num_batched_tokens == QUICK.budget
    assert job.no_progress


def test_a_run_arg_wins_over_the_benchmarks_own_setting(tmp_path: Path) -> None:
    from afd_tools.bench.prefill import sweeps_of
    from afd_tools.bench.prefill_matrix import QUICK, point_job
    from afd_tools.cli import build_parser

    bench = build_parser().parse_args(["bench", "prefill", "--run-arg=--stages=3"])
    job = point_job(sweeps_of(bench), "tiny", "uniform", QUICK, tmp_path)
    assert job.stages == 3
    assert job.workload_file == tmp_path / "tiny-uniform.jsonl"
    assert "--stages 3" in job.command_line()


def _bench_run(placement: dict[str, Any] | None) -> Any:
    from afd_tools.bench.prefill_matrix import Point
    from afd_tools.bench.prefill_table import BenchRun
    from afd_tools.prefill.run_report import RunReport
    from afd_tools.run.job import RunJob

    report = None
    if placement is not None:
        deployment = RunJob(dtype="float32", backend="reference", transport="shm", colocated="dp")
        report = RunReport(deployment.deployment("cpu"), (), {}, placement=placement)
    point = Point("tiny", "uneven", 1, 1, None, None, 2, ("async", "sync", "colocated"))
    return BenchRun(point, "afd run", 0 if report else 1, 1.0, report)


def test_bench_prefill_says_under_its_table_where_the_ranks_ran() -> None:
    from afd_tools.bench.prefill_table import placement_notes

    one_gpu = {
        "kind": "cuda",
        "sharing": "GPUs shared under CUDA MPS: cuda:0 attention rank 0 50 %, ffn rank 0 50 %",
        "colocated_label": "colocated: monolithic model on one GPU (DP1, EP1)",
    }
    cpu = {"kind": "cpu", "sharing": "none", "colocated_label": "colocated: DP2+EP over gloo"}
    results = [_bench_run(one_gpu), _bench_run(one_gpu), _bench_run(None), _bench_run(cpu)]
    assert placement_notes(results) == [
        "Placement: cuda (GPUs shared under CUDA MPS: cuda:0 attention rank 0 50 %, ffn rank 0 "
        "50 %); colocated: monolithic model on one GPU (DP1, EP1).",
        "Placement: cpu; colocated: DP2+EP over gloo.",
    ]
    # Each distinct hardware record once, after the placement it came with.
    h200 = {"cpu": "AMD EPYC", "cores": 16, "python": "3.11.9", "torch": "2.11.0+cu130",
            "cuda": "13.0", "gpus": [{"name": "NVIDIA H200", "memory_mib": 143771,
                                      "driver": "580.159.04"}]}  # fmt: skip
    recorded = [_bench_run(one_gpu | {"hardware": h200})] * 2
    assert placement_notes(recorded) == [
        placement_notes(results)[0],
        "Hardware: 1 x NVIDIA H200 (143771 MiB, driver 580.159.04); AMD EPYC (16 cores); "
        "Python 3.11.9, torch 2.11.0+cu130, CUDA 13.0.",
    ]
