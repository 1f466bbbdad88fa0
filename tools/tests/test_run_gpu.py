"""``afd run`` on CUDA GPUs: the main job with real model code on the GPU, every output
checked against the monolithic model on a GPU (bf16 tolerance), and nothing left running
or allocated afterwards. Skipped without a GPU (CI); ``tools/gpu/suite`` runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SMALL = [
    "run",
    "--device",
    "cuda",
    "--requests",
    "8",
    "--max-prompt-len",
    "96",
    "--max-num-batched-tokens",
    "128",
    "--attention-ranks",
    "1",
    "--ffn-ranks",
    "1",
    "--no-progress",
]


def _afd(tmp_path: Path, *argv: str) -> tuple[dict[str, object], str]:
    """Run ``afd`` in a child process (a fresh CUDA context, as a user's shell would) and
    return its JSON report and stdout; the child must exit 0."""
    report = tmp_path / "run.json"
    result = subprocess.run(
        [sys.executable, "-m", "afd_tools.cli", *argv, "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(report.read_text()), result.stdout


def _no_afd_process_left() -> None:
    names = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                names.append((entry / "comm").read_text().strip())
            except OSError:
                continue
    assert not [n for n in names if n.startswith(("afd-attention", "afd-ffn"))], names


def test_every_mode_on_gpus_over_host_staging(tmp_path: Path) -> None:
    """Models on the GPU, rows through host shared memory; GPUs shared when there are fewer
    than two (the functional path on any CUDA machine)."""
    extra = ["--share-gpus"] if GPUS < 2 else []
    data, out = _afd(tmp_path, *SMALL, "--transport", "shm", "--stages", "2", *extra)
    assert "PASS: every request's final hidden state matches" in out
    assert data["verification_failures"] == {}
    assert set(data["verification_worst"]) == {"async", "sync", "colocated"}
    placement = data["placement"]
    assert isinstance(placement, dict)
    assert placement["kind"] == "cuda"
    _no_afd_process_left()


@pytest.mark.skipif(GPUS < 2, reason="NVSHMEM and NCCL want one process per GPU: needs two")
def test_every_mode_on_two_gpus_over_nvshmem_and_nccl(tmp_path: Path) -> None:
    data, out = _afd(tmp_path, *SMALL, "--stages", "2")
    assert "colocated = DP2+EP over nccl" in out
    assert data["verification_failures"] == {}
    args = data["args"]
    assert isinstance(args, dict)
    assert args["transport"] == "nvshmem"
    _no_afd_process_left()


def test_float32_on_the_gpu_matches_the_reference_to_float32_precision(tmp_path: Path) -> None:
    """In float32 no rounding hides a wrong row: every mode within 1e-5 of the reference."""
    extra = ["--share-gpus", "--transport", "shm"] if GPUS < 2 else []
    data, out = _afd(tmp_path, *SMALL, "--dtype", "float32", *extra)
    assert "(tolerance 1e-05; worst " in out
    assert data["verification_failures"] == {}


def _gpu_processes() -> set[int]:
    """Pids holding a CUDA context on any GPU (nvidia-smi's compute apps)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def test_ctrl_c_stops_every_rank_and_frees_every_gpu(tmp_path: Path) -> None:
    """Ctrl-C to the launcher's process group while the ranks wait for sparse arrivals:
    exit 130, every rank process gone, and none of them holds GPU memory any more."""
    import os
    import signal
    import time

    extra = ["--share-gpus", "--transport", "shm"] if GPUS < 2 else []
    before = _gpu_processes()
    argv = [*SMALL, *extra, "--requests", "400", "--rate", "20"]
    process = subprocess.Popen(
        [sys.executable, "-m", "afd_tools.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    try:
        deadline = time.monotonic() + 240
        while len(_gpu_processes() - before) < 2:  # both ranks hold a context
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the ranks never started on the GPU"
            time.sleep(0.5)
        time.sleep(2)
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 130, stderr
        assert "interrupted; every rank process was stopped" in stderr
        deadline = time.monotonic() + 30
        while _gpu_processes() - before:
            assert time.monotonic() < deadline, _gpu_processes() - before
            time.sleep(0.5)
        _no_afd_process_left()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
