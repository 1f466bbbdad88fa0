"""tools/gpu/share_probe.py on the CPU: its arguments, its table, how it reads a client's
answer, and that a whole probe against the MPS stand-in -- where every client fails, there
being no GPU -- reports each failure by share and setting and leaves no daemon behind."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from scripts import load_script

from afd_transport_nvshmem import mps
from afd_transport_nvshmem.mps_stand_in import environment_without_mps, wait_gone, write_stand_in

Bad = argparse.ArgumentTypeError
SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "share_probe.py"


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    return load_script("gpu/share_probe.py")


def test_shares_and_settings_are_checked_and_named(probe: ModuleType) -> None:
    assert probe.parse_shares("25, 33,50") == (25, 33, 50)
    with pytest.raises(Bad, match=r"percentages of 1 to 100; got '0,101' \(0, 101 out"):
        probe.parse_shares("0,101")
    with pytest.raises(Bad, match=r"separated by commas, e.g. 25,33,50; got .25;33."):
        probe.parse_shares("25;33")
    assert probe.parse_settings("default,lt-target-known") == ("default", "lt-target-known")
    with pytest.raises(Bad, match="--settings takes some of default, lt-target-known"):
        probe.parse_settings("default,fast")
    shown = subprocess.run(
        [sys.executable, str(SCRIPT), "--shares", "0"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 2
    assert "--shares takes percentages of 1 to 100; got '0' (0 out of range)" in shown.stderr


def test_the_planned_sm_count_per_setting(probe: ModuleType) -> None:
    assert probe.planned_sms("default", 42) is None
    assert probe.planned_sms("lt-no-splitk", 42) is None
    assert probe.planned_sms("lt-target-known", 42) == 32  # 33 %
    assert probe.planned_sms("lt-target-known", 52) == 32  # 40 %
    assert probe.planned_sms("lt-target-known", 98) == 66  # 75 %
    assert probe.planned_sms("lt-target-known", 132) == 132
    assert probe.planned_sms("lt-target-known", 20) == 20  # never more than it sees


def test_a_clients_answer_or_failure_becomes_a_table_row(probe: ModuleType) -> None:
    answer = {"sms": 42, "planned_sms": 32, "unwritten": 3, "products": 154,
              "first": "bfloat16 [49 x 1408] @ [1408 x 2048]: 3 of 100352 elements unwritten",
              "tflops": 301.4}  # fmt: skip
    ok = subprocess.CompletedProcess([], 0, "warming up\n" + json.dumps(answer) + "\n", "")
    found = probe.finding_from(33, "lt-target-known", ok)
    assert found.error is None
    assert not found.writes_everything
    failed = subprocess.CompletedProcess([], 1, "", "Traceback ...\nRuntimeError: no GPU\n")
    lost = probe.finding_from(40, "default", failed)
    assert lost.error == "exit 1: RuntimeError: no GPU"
    garbled = probe.finding_from(40, "default", subprocess.CompletedProcess([], 0, "{", ""))
    assert garbled.error == "exit 0: (no output)"
    rows = probe.table([found, lost]).splitlines()
    assert rows[0].startswith("| share % | SMs seen | setting | SMs planned | unwritten products")
    assert rows[2] == (
        "| 33 | 42 | lt-target-known | 32 | 3 of 154 | bfloat16 [49 x 1408] @ [1408 x 2048]: 3 of "
        "100352 elements unwritten | 301 |"
    )
    assert rows[3] == "| 40 | - | default | - | failed: exit 1: RuntimeError: no GPU | - | - |"


def test_a_probe_runs_each_client_as_an_mps_client_and_stops_its_daemon(
    probe: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the MPS stand-in, with clients that fail as they would without a GPU:
    ``default`` fails, so the other settings run at that share too, each in the daemon's
    environment at its share; each failure is a row naming it, and the private daemon is
    gone afterwards. (A share where ``default`` writes everything gets no other setting.)"""
    monkeypatch.setattr(probe.os, "environ", environment_without_mps())
    started: list[Any] = []
    original = mps.MpsDaemon.start

    def start(*args: Any, **kwargs: Any) -> Any:
        daemon = original(*args, **kwargs)
        started.append(daemon)
        return daemon

    seen: list[tuple[int, str, str | None, bool]] = []

    def client(share: int, setting: str, env: dict[str, str]) -> Any:
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", "")
        answers = bool(pipe) and (Path(pipe) / "control").exists()
        seen.append((share, setting, env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), answers))
        if share == 50:
            return probe.Finding(share, setting, sms=66, unwritten=0, products=154)
        return probe.Finding(share, setting, error="exit 1: RuntimeError: no GPU")

    monkeypatch.setattr(mps.MpsDaemon, "start", start)
    monkeypatch.setattr(probe, "_run_client", client)
    control = write_stand_in(tmp_path / "bin")
    findings = probe.probe((33, 50), ("default", "lt-target-known"), control=control)
    assert seen == [
        (33, "default", "33", True),
        (33, "lt-target-known", "33", True),
        (50, "default", "50", True),
    ]
    assert [f.error for f in findings] == ["exit 1: RuntimeError: no GPU"] * 2 + [None]
    assert len(started) == 1
    assert started[0].owned
    assert wait_gone(started[0].pipe_directory)
    assert mps._processes_with(started[0].pipe_directory) == []


def test_without_a_gpu_it_says_so_and_exits_2(
    probe: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the probe would run")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    assert probe.main(["--shares", "25"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tools/gpu/share_probe.py: needs a CUDA GPU (none is visible)"
    )
    with pytest.raises(SystemExit) as exited:
        probe.main(["--json", str(tmp_path)])  # a directory: refused before anything runs
    assert exited.value.code == 2
    assert "is a directory; give a file name" in capsys.readouterr().err
