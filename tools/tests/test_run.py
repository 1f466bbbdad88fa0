"""`afd run` end to end: real processes, verified outputs, report, JSON, plot, faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from afd_protocol.shm import leftover_segments
from afd_tools.cli import main

SMALL = [
    "run",
    "--requests",
    "8",
    "--max-prompt-len",
    "48",
    "--max-num-batched-tokens",
    "64",
    "--no-progress",
]


def test_all_modes_verify_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, plot = tmp_path / "run.json", tmp_path / "run.png"
    before = set(leftover_segments())
    assert main([*SMALL, "--json", str(report), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "PASS: every request's final hidden state matches" in out
    assert "async/sync tokens/s" in out
    data = json.loads(report.read_text())
    assert set(data["modes"]) == {"async", "sync", "colocated"}
    for summary in data["modes"].values():
        assert summary["tokens_per_s"] > 0
        assert 0 <= summary["ttft_p50"] <= summary["ttft_p99"]
    assert data["verification_failures"] == {}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(leftover_segments()) <= before


def test_shared_experts_on_ffn_in_bf16_with_poisson_arrivals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        *SMALL,
        "--mode",
        "async",
        "--shared",
        "ffn",
        "--dtype",
        "bfloat16",
        "--rate",
        "200",
        "--assign",
        "least-tokens",
    ]
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out


def test_configuration_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--rate", "-2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "afd run: error: --rate must be a positive number of requests per second, got -2.0"
    ]


def _descendants(pid: int) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        found[int(entry.name)] = (ppid, comm)
    out, frontier = {}, {pid}
    while frontier:
        children = {p for p, (pp, _) in found.items() if pp in frontier and p not in out}
        out.update({p: found[p][1] for p in children})
        frontier = children
    return out


@pytest.mark.timeout(180)
def test_a_killed_ffn_rank_stops_the_run_naming_it_and_leaves_nothing_behind() -> None:
    argv = [
        sys.executable,
        "-m",
        "afd_tools.cli",
        *SMALL,
        "--requests",
        "400",
        "--rate",
        "40",
        "--mode",
        "async",
        "--timeout",
        "20",
    ]
    before = set(leftover_segments())
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        victim = None
        while victim is None and time.monotonic() < deadline:
            for pid, comm in _descendants(process.pid).items():
                if comm == "afd-ffn1":
                    victim = pid
            time.sleep(0.2)
        assert victim is not None, "the FFN rank 1 process never appeared"
        time.sleep(2.0)  # let it serve some work first
        started = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = process.communicate(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode not in (0, None)
    assert "ffn rank 1: killed by SIGKILL" in err
    assert "Traceback" not in err
    assert elapsed < 30
    assert _descendants(process.pid) == {}
    assert not [p for p in _descendants(os.getpid()).values() if p.startswith("afd-")]
    assert set(leftover_segments()) <= before
