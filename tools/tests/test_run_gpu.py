"""``afd run`` on CUDA GPUs: the main job with real model code on the GPU, every output
checked against the monolithic model on a GPU (bf16 tolerance), and nothing left running
or allocated afterwards. With one GPU the ranks share it as clients of a private CUDA MPS
daemon that ``afd run`` starts and stops (``--share-gpus``), so NVSHMEM runs there too.
Skipped without a GPU (CI); ``tools/gpu/suite`` runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARE = ["--share-gpus"] if GPUS < 2 else []
"""1A1F on one GPU: both ranks on it, as MPS clients at 50 % each."""
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


def _afd_processes() -> set[str]:
    """The process names of the afd rank processes running (``afd-attn0``, ``afd-ffn0``)."""
    names = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                names.add((entry / "comm").read_text().strip())
            except OSError:
                continue
    return {n for n in names if n.startswith(("afd-attn", "afd-ffn"))}


def _no_afd_process_left() -> None:
    assert not _afd_processes()


def _mps_state() -> tuple[set[int], set[Path]]:
    """The MPS processes running (control daemons and servers, anyone's) and afd's private
    MPS directories: a run must leave both as it found them."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().startswith("nvidia-cuda-mps"):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids, set(Path(tempfile.gettempdir()).glob("afd-mps-*"))


def _nothing_of_mps_left(before: tuple[set[int], set[Path]]) -> None:
    deadline = time.monotonic() + 30
    while True:
        pids, folders = _mps_state()
        if pids <= before[0] and folders <= before[1]:
            return
        assert time.monotonic() < deadline, (pids - before[0], folders - before[1])
        time.sleep(0.5)


def _check_one_gpu_sharing(
    placement: dict[str, object], out: str, attention: int = 50, ffn: int = 50
) -> None:
    """With one GPU: the two ranks were MPS clients at these shares (afd run's default:
    50 % each), and the colocated baseline was the monolithic model on the whole GPU."""
    assert placement["mps_shares"] == {"attention rank 0": attention, "ffn rank 0": ffn}
    shared = f"cuda:0 attention rank 0 {attention} %, ffn rank 0 {ffn} %"
    assert f"(GPUs shared under CUDA MPS: {shared})" in out
    assert "; colocated: monolithic model on one GPU (DP1, EP1)" in out
    assert placement["colocated_label"] == "colocated: monolithic model on one GPU (DP1, EP1)"


def _check_warm_baseline_and_hardware(data: dict[str, object]) -> None:
    """On a GPU every mode ran warm, the colocated baseline too (5746507: without it the
    monolithic process stalled seconds after its first step), and the report names the GPUs
    it ran on, as nvidia-smi lists them."""
    deployment, placement = data["deployment"], data["placement"]
    assert isinstance(deployment, dict)
    assert isinstance(placement, dict)
    assert deployment["warm_pass"] is True
    assert deployment["baseline_warm_pass"] is True
    gpus = placement["hardware"]["gpus"]
    assert len(gpus) >= GPUS
    assert all(g["name"] and g["memory_mib"] > 0 and g["driver"] for g in gpus)


def _check_step_records(data: dict[str, object]) -> None:
    """One replica: its steps' records (timed by CUDA events) add up to the breakdown --
    the dispatches to its MoE layers, the compute to its compute per layer times those."""
    modes = data["modes"]
    assert isinstance(modes, dict)
    for mode in ("async", "sync"):
        steps, breakdown = modes[mode]["attention_steps"], modes[mode]["breakdown"]
        assert sum(step[2] for step in steps) == breakdown["moe_layers"], mode
        compute = breakdown["compute_ms_per_layer"] * breakdown["moe_layers"] / 1e3
        assert sum(step[3] for step in steps) == pytest.approx(compute, rel=1e-6), mode
        assert all(step[3] > 0 for step in steps), mode


def test_every_mode_on_gpus_over_host_staging(tmp_path: Path) -> None:
    """Models on the GPU, rows through host shared memory; GPUs shared (under CUDA MPS)
    when there are fewer than two."""
    before = _mps_state()
    data, out = _afd(tmp_path, *SMALL, "--transport", "shm", "--stages", "2", *SHARE)
    assert "PASS: every request's final hidden state matches" in out
    assert data["verification_failures"] == {}
    assert set(data["verification_worst"]) == {"async", "sync", "colocated"}
    placement = data["placement"]
    assert isinstance(placement, dict)
    assert placement["kind"] == "cuda"
    if GPUS < 2:
        _check_one_gpu_sharing(placement, out)
    _check_warm_baseline_and_hardware(data)
    _no_afd_process_left()
    _nothing_of_mps_left(before)


def test_every_mode_over_nvshmem_and_the_colocated_baseline(tmp_path: Path) -> None:
    """Two GPUs: one rank each over NVSHMEM, colocated DP2+EP2 over NCCL. One GPU: both
    ranks on it under CUDA MPS over NVSHMEM (full MPG mode), each at a share of its own
    (--mps-attention-share 25 --mps-ffn-share 50, which must reach it: bf16 at a 25 %
    attention share, as 2A1F runs; shares among afd_transport_nvshmem.mps.VERIFIED_SHARES,
    at 30/70 bf16 results were NaN on the H200), colocated = the monolithic model on the
    whole GPU; the MPS daemon is gone afterwards."""
    before = _mps_state()
    chosen = ["--mps-attention-share", "25", "--mps-ffn-share", "50"] if GPUS < 2 else []
    data, out = _afd(tmp_path, *SMALL, "--stages", "2", *SHARE, *chosen)
    assert data["verification_failures"] == {}
    assert set(data["verification_worst"]) == {"async", "sync", "colocated"}
    _check_step_records(data)
    _check_warm_baseline_and_hardware(data)
    args, placement = data["args"], data["placement"]
    assert isinstance(args, dict)
    assert isinstance(placement, dict)
    assert args["transport"] == "nvshmem"
    if GPUS >= 2:
        assert "; colocated: DP2+EP over nccl" in out
        assert placement["mps_shares"] == {}
    else:
        _check_one_gpu_sharing(placement, out, attention=25, ffn=50)
    _no_afd_process_left()
    _nothing_of_mps_left(before)


@pytest.mark.parametrize("graphs", [[], ["--exchange-graphs", "4", "--peer-puts"]])
def test_float32_on_the_gpu_matches_the_reference_to_float32_precision(
    tmp_path: Path, graphs: list[str]
) -> None:
    """In float32 no rounding hides a wrong row: every mode within 1e-5 of the reference
    (over NVSHMEM; on one GPU under CUDA MPS), also with the exchange replayed from CUDA
    graphs and every slot sent by the put path. (The replayed exchange over the mapped
    path is the next test's, with the FFN loop replayed too; with an eager FFN rank it is
    afd-transport-nvshmem's test_graph_replayed_exchange_matches_the_reference. A run of
    its own here cost ~23 s of the suite's ten minutes.)"""
    data, out = _afd(tmp_path, *SMALL, "--dtype", "float32", *SHARE, *graphs)
    assert "(tolerance 1e-05; worst " in out
    assert data["verification_failures"] == {}
    deployment = data["deployment"]
    assert deployment["exchange_graphs"] == (4 if graphs else 0)  # type: ignore[index]
    assert deployment["peer_puts"] == ("--peer-puts" in graphs)  # type: ignore[index]


def test_both_sides_replayed_from_cuda_graphs_match_the_reference(tmp_path: Path) -> None:
    """--exchange-graphs 4 --ffn-graph --backend triton: the attention exchange and the FFN
    ranks' whole serve loop replayed from CUDA graphs, every mode verified (float32)."""
    both = ["--exchange-graphs", "4", "--ffn-graph", "--backend", "triton"]
    data, out = _afd(tmp_path, *SMALL, "--dtype", "float32", *SHARE, *both)
    assert "(tolerance 1e-05; worst " in out
    assert data["verification_failures"] == {}
    assert data["deployment"]["ffn_graph"] is True  # type: ignore[index]


def _gpu_processes() -> set[int]:
    """Pids holding a CUDA context on any GPU (nvidia-smi's compute apps)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


@pytest.mark.parametrize("transport", ["shm", "nvshmem"])
def test_ctrl_c_stops_every_rank_and_frees_every_gpu(tmp_path: Path, transport: str) -> None:
    """Ctrl-C to the launcher's process group while the ranks wait for sparse arrivals:
    exit 130, every rank process gone, none of them holds GPU memory any more, and (one
    GPU) the MPS daemon and its directories are gone too."""
    before = _gpu_processes()
    mps_before = _mps_state()
    argv = [*SMALL, *SHARE, "--transport", transport, "--requests", "400", "--rate", "20"]
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
        # Both ranks run and the GPU has a new context (under MPS nvidia-smi may list the MPS
        # server rather than its clients), then time for both to be inside the run.
        while _afd_processes() != {"afd-attn0", "afd-ffn0"} or not _gpu_processes() - before:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the ranks never started on the GPU"
            time.sleep(0.5)
        time.sleep(5)
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 130, stderr
        assert "interrupted; every rank process was stopped" in stderr
        deadline = time.monotonic() + 30
        while _gpu_processes() - before:
            assert time.monotonic() < deadline, _gpu_processes() - before
            time.sleep(0.5)
        _no_afd_process_left()
        _nothing_of_mps_left(mps_before)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
