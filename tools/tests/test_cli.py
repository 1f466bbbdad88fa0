"""The `afd` command: exit codes, one-line errors, help text, and the roundtrip check."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from afd_tools.cli import main


def test_roundtrip_passes_and_reports_what_it_checked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["roundtrip", "--tokens", "24", "--hidden", "16", "--experts", "16", "--layers", "2"]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0
    assert "PASS: every combined output matches the per-token reference" in out
    assert "FFN rank 1: served" in out


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_roundtrip_bf16_with_uneven_expert_split(
    shared: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "roundtrip",
        "--dtype",
        "bfloat16",
        "--shared",
        shared,
        "--ffn-ranks",
        "3",
        "--experts",
        "10",
        "--topk",
        "3",
        "--tokens",
        "20",
        "--hidden",
        "16",
        "--layers",
        "2",
    ]
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out


def test_configuration_errors_are_one_line_messages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roundtrip", "--ffn-ranks", "80", "--experts", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "use at most 64 FFN ranks" in err[0]


def test_console_script_help_lists_every_option() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "afd_tools.cli", "roundtrip", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for option in (
        "--layers",
        "--timeout",
        "--attention-ranks",
        "--ffn-ranks",
        "--experts",
        "--topk",
        "--tokens",
        "--hidden",
        "--shared",
        "--dtype",
        "--seed",
    ):
        assert option in result.stdout
    assert "default" in result.stdout


def test_bench_transport_shm_prints_its_tables_and_writes_json(tmp_path) -> None:
    import json

    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "transport",
        "--iterations",
        "200",
        "--repeats",
        "3",
        "--max-tokens",
        "256",
        "--max-bytes",
        str(64 << 10),
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "shm"
    assert 0 < report["latency_us"]["p50"] < 100_000
    assert set(report["bandwidth"]) == {str(4 << 10), str(64 << 10)}
    for point in report["bandwidth"].values():
        assert all(seconds > 0 for seconds in point.values())
    layer = report["layer"]
    assert set(layer) == {"per_choice", "per_rank", "per_rank_ffn"}
    assert all(layer[f]["256"]["rank0"] > 0 for f in layer)
    # Bytes one rank moves per layer: 256 tokens x top-6 rows of 2048 bf16 each way, per
    # choice; per rank, a token row (+ 6 ids and weights) at most once per FFN rank (2).
    row = 2048 * 2
    assert layer["per_choice"]["256"]["bytes"] == 2 * 256 * 6 * row
    assert layer["per_rank_ffn"]["256"]["bytes"] <= 2 * 2 * 256 * row + 2 * 256 * 48
    assert (
        layer["per_rank_ffn"]["256"]["bytes"]
        < layer["per_rank"]["256"]["bytes"]
        < layer["per_choice"]["256"]["bytes"]
    )


def test_bench_transport_cam_emulator_runs_beside_shm(tmp_path) -> None:
    import json

    out = tmp_path / "cam.json"
    argv = ["bench", "transport", "--backend", "cam-emulator", "--repeats", "2"]
    assert main([*argv, "--max-tokens", "256", "--json", str(out)]) == 0
    layer = json.loads(out.read_text())["layer"]
    assert set(layer) == {"shm per_rank", "cam-emulator"}
    for name in layer:
        assert layer[name]["256"]["rank0"] > 0
        assert layer[name]["256"]["bytes"] == layer["shm per_rank"]["256"]["bytes"]


def test_bench_rejects_arguments_it_cannot_measure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "transport", "--iterations", "10", "--max-bytes", "100"]) == 2
    err = capsys.readouterr().err
    assert "--iterations must be >= 200" in err
    assert "--max-bytes must be >= 4096" in err


def test_the_registry_holds_every_afd_transport_and_each_has_a_bench() -> None:
    from afd_protocol import DeviceSharing, available_transports
    from afd_tools.bench.cli import TRANSPORT_BENCHES

    transports = available_transports()
    assert {name: t.devices for name, t in transports.items()} == {
        "shm": {"cpu", "cuda"},
        "nvshmem": {"cuda"},
        "cam-emulator": {"cpu"},
    }
    assert list(transports) == ["shm", "nvshmem", "cam-emulator"]
    assert transports["nvshmem"].device_sharing is DeviceSharing.MPS
    assert set(TRANSPORT_BENCHES) >= set(transports)


@pytest.mark.parametrize("name", ["bogus", "host"])  # host: the old name of shm, gone
def test_bench_refuses_a_transport_the_registry_does_not_hold(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "transport", "--backend", name]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"afd bench transport: error: unknown transport {name!r}; the installed ones are: "
        "shm, nvshmem, cam-emulator"
    ]


def test_run_names_the_package_of_a_transport_that_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import metadata

    from afd_protocol import transports

    shm = metadata.EntryPoint(
        "shm", "afd_protocol.shm_registration:SHM_TRANSPORT", "afd.transports"
    )
    real = metadata.entry_points

    def only_shm(**params: Any) -> Any:
        return [shm] if params.get("group") == "afd.transports" else real(**params)

    monkeypatch.setattr(metadata, "entry_points", only_shm)
    # nor importable from a source tree
    monkeypatch.setattr(transports, "SOURCE_TREE_SPECS", {"shm": shm.value})
    argv = ["run", "--device", "cpu", "--transport", "cam-emulator", "--no-progress"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "afd run: error: transport 'cam-emulator' is not installed: pip install "
        "afd-transport-cam (installed here: shm)"
    ]


def test_soak_judges_growth_from_the_samples() -> None:
    from afd_tools.soak import RankSamples

    steady = RankSamples("afd-ffn0", rss=[300 << 20] * 40, fds=[8] * 40)
    assert steady.verdict()[0]
    leaking = RankSamples("afd-ffn0", rss=[(300 + 2 * i) << 20 for i in range(40)], fds=[8] * 40)
    ok, text = leaking.verdict()
    assert not ok
    assert "RSS" in text
    fd_leak = RankSamples("afd-ffn0", rss=[300 << 20] * 40, fds=[8 + i for i in range(40)])
    assert not fd_leak.verdict()[0]
    assert not RankSamples("afd-ffn0", rss=[1] * 3, fds=[1] * 3).verdict()[0]


@pytest.mark.timeout(600)
def test_a_short_soak_verifies_every_output_and_finds_no_growth(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The CI version of `make soak` (1,000 requests): every mode, Poisson arrivals, chunked
    long prompts; 150 requests at 25/s sample every rank about 100 times (the verdict needs
    8), in a third of the time of the 300 it used to run."""
    assert main(["soak", "--requests", "150", "--rate", "25"]) == 0
    out = capsys.readouterr().out
    assert "PASS: outputs verified, no rank grew" in out
    assert out.count(" ok\n") == 4  # two attention replicas, two FFN ranks


def test_bench_prefill_uniform_has_the_uneven_total_and_refuses_docs_without_markers(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from afd_tools.bench.prefill_matrix import FULL, QUICK, workload_lengths
    from afd_tools.prefill.workload import prompt_lengths

    uniform = workload_lengths("uniform", "v2-lite", QUICK, 3)
    assert uniform is not None
    assert sum(uniform) == sum(prompt_lengths("uneven", QUICK.requests, 3, QUICK.max_prompt_len))
    assert max(uniform) - min(uniform) <= 1
    for size, requests in ((QUICK, 12), (FULL, 16)):
        long = workload_lengths("long", "v3-slice", size, 3)
        assert long is not None
        assert len(long) == requests == size.long_requests
        assert all(size.long_range[0] <= n <= size.long_range[1] for n in long)
    docs = tmp_path / "plain.md"
    docs.write_text("no markers here\n")
    assert main(["bench", "prefill", "--docs", str(docs)]) == 2
    assert "has no <!-- afd bench prefill --> ... <!-- /afd bench prefill --> block" in (
        capsys.readouterr().err
    )
    assert docs.read_text() == "no markers here\n"


def test_start_methods_run_interleaved_and_are_compared_figure_by_figure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    from afd_protocol.launch import START_METHOD_ENV
    from afd_tools.bench.start_methods import compare_start_methods

    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    seen: list[str] = []
    figures = {"forkserver": iter([2.0, 4.0, 3.0]), "spawn": iter([1.0, 1.5, 2.0])}

    def measure() -> dict[str, Any]:
        method = os.environ[START_METHOD_ENV]
        seen.append(method)
        return {"layer": {"device": {"1024": next(figures[method]), "ok": True}}, "other": 9}

    out = compare_start_methods(measure, ["forkserver", "spawn"], 3)
    assert seen == ["forkserver", "spawn"] * 3  # A/B/A/B/A/B
    assert os.environ[START_METHOD_ENV] == "spawn"  # restored
    assert out["summary"] == {
        "device/1024": {
            "forkserver": {"median": 3.0, "low": 2.0, "high": 4.0},
            "spawn": {"median": 1.5, "low": 1.0, "high": 2.0},
        }
    }
    assert len(out["start_methods"]["spawn"]) == 3
    row = next(line for line in capsys.readouterr().out.splitlines() if "device/1024" in line)
    assert row.split()[-1] == "0.50"  # spawn / forkserver

    def failing() -> dict[str, Any]:
        raise RuntimeError("rank failed")

    monkeypatch.delenv(START_METHOD_ENV)
    with pytest.raises(RuntimeError, match="rank failed"):
        compare_start_methods(failing, ["spawn"], 1)
    assert START_METHOD_ENV not in os.environ  # left as it was found


def test_bench_rounds_need_two_start_methods(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "transport", "--rounds", "2", "--start-method", "spawn"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "afd bench transport: error: --rounds interleaves several --start-method: give two"
    )
