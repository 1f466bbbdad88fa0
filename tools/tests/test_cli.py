"""The `afd` command: exit codes, one-line errors, help text, and the roundtrip check."""

from __future__ import annotations

import subprocess
import sys

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
    """The CI version of `make soak`: every mode, Poisson arrivals, chunked long prompts."""
    assert main(["soak", "--requests", "300", "--rate", "25"]) == 0
    out = capsys.readouterr().out
    assert "PASS: outputs verified, no rank grew" in out
    assert out.count(" ok\n") == 4  # two attention replicas, two FFN ranks
