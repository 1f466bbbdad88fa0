"""The vLLM plugin's ``GpuAsyncAFDConnector`` on a GPU (no vLLM: the GPU host has none).

``afd-vllm ffn --device cuda:0`` serves an attention process that runs afd_models'
attention role over the same connector; its prefill must equal the monolithic model's
(float32 to 1e-5, bfloat16 to the run's 2e-2). With one GPU both processes are clients of
a private CUDA MPS daemon at 50 % of the SMs each (NVSHMEM's full multi-process-per-GPU
mode), started and stopped here; with two, one GPU each. Ctrl-C to the FFN process stops
it with its own line and exit status 130, the attention side's next prefill fails with a
named error well within its timeout, and neither process outlives the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from afd_models import RandomWeights, preset
from afd_models.weights import materialize, save_checkpoint
from afd_protocol import relative_error

pytestmark = pytest.mark.gpu

BUDGET = 64
WORKER = Path(__file__).with_name("afd_vllm_gpu_attention.py")
LOOPBACK = {
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _gpu_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        from afd_transport_nvshmem import NvshmemUnavailable, find_host_library
    except ImportError:
        return "needs afd-transport-nvshmem (pip install afd-vllm[cuda])"
    try:
        find_host_library()
    except NvshmemUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def placement() -> Iterator[tuple[dict[str, str], dict[str, str], str]]:
    """(attention env, ffn env, ffn device): one GPU each, or both on cuda:0 under MPS."""
    missing = _gpu_missing()
    if missing:
        pytest.skip(missing)
    if torch.cuda.device_count() >= 2:
        yield {}, {}, "cuda:1"
        return
    from afd_transport_nvshmem.mps import MpsDaemon

    with MpsDaemon.start() as daemon:
        env = daemon.client_environment(50)
        yield env, env, "cuda:0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _additional(role: str, port: int) -> str:
    return json.dumps(
        {
            "afd": {
                "role": role,
                "connector": "GpuAsyncAFDConnector",
                "port": port,
                "connector_extra_config": {"connect_timeout_s": 120},
            }
        }
    )


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **LOOPBACK, **extra}


@contextlib.contextmanager
def _processes(*procs: subprocess.Popen[str]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def _start_ffn(
    model: Path, port: int, dtype: str, device: str, env: dict[str, str]
) -> subprocess.Popen[str]:
    backend = "grouped_mm" if dtype == "bfloat16" else "reference"
    command = [
        sys.executable, "-m", "afd_vllm.cli", "ffn", "--model", str(model),
        "--dtype", dtype, "--device", device, "--backend", backend,
        "--max-num-batched-tokens", str(BUDGET),
        "--additional-config", _additional("ffn", port), "--connect-timeout", "120",
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _start_attention(
    model: Path, out: Path, port: int, dtype: str, mode: str, env: dict[str, str]
) -> subprocess.Popen[str]:
    command = [
        sys.executable, str(WORKER), str(model), str(out), _additional("attention", port),
        dtype, str(BUDGET), mode,
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        env=_env(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = preset("tiny")
    folder = tmp_path_factory.mktemp("gpu-connector")
    return save_checkpoint(folder / "model", config, materialize(config, RandomWeights(7)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_gpu_connector_serves_a_prefill_equal_to_the_monolithic_model(
    placement: tuple[dict[str, str], dict[str, str], str],
    checkpoint: Path,
    tmp_path: Path,
    dtype: str,
    tolerance: float,
) -> None:
    attention_env, ffn_env, ffn_device = placement
    port = _free_port()
    ffn = _start_ffn(checkpoint, port, dtype, ffn_device, ffn_env)
    attention = _start_attention(
        checkpoint, tmp_path / "out.pt", port, dtype, "verify", attention_env
    )
    with _processes(ffn, attention):
        _, attention_err = attention.communicate(timeout=240)
        assert attention.returncode == 0, attention_err[-3000:]
        ffn_out, ffn_err = ffn.communicate(timeout=60)
    assert ffn.returncode == 0, ffn_err[-3000:]
    assert "afd-vllm ffn: rank 0 ready (8 experts" in ffn_out
    layers = len(preset("tiny").moe_layers)
    assert f"served {layers} work items (replica 0: {layers}); shut down" in ffn_out
    saved = torch.load(tmp_path / "out.pt")
    got, expected = saved["got"], saved["expected"]
    assert got.shape == expected.shape == (sum((5, 17, 40)), preset("tiny").hidden_size)
    assert bool(torch.isfinite(got).all())
    assert bool(torch.isfinite(expected).all())
    error = relative_error(got, expected)
    assert error < tolerance, f"{dtype}: relative error {error:.3g} >= {tolerance}"


@pytest.mark.timeout(300)
def test_ctrl_c_to_the_gpu_ffn_process_stops_it_and_fails_the_attention_side_by_name(
    placement: tuple[dict[str, str], dict[str, str], str], checkpoint: Path, tmp_path: Path
) -> None:
    attention_env, ffn_env, ffn_device = placement
    port = _free_port()
    ffn = _start_ffn(checkpoint, port, "float32", ffn_device, ffn_env)
    attention = _start_attention(
        checkpoint, tmp_path / "unused.pt", port, "float32", "interrupt", attention_env
    )
    with _processes(ffn, attention):
        assert attention.stdout is not None
        assert attention.stdin is not None
        line = attention.stdout.readline()
        assert line.strip() == "prefilled", attention.stderr.read() if attention.stderr else ""
        ffn.send_signal(signal.SIGINT)
        ffn_out, ffn_err = ffn.communicate(timeout=60)
        attention.stdin.write("go\n")
        attention.stdin.flush()
        attention_out, attention_err = attention.communicate(timeout=120)
    assert ffn.returncode == 130, ffn_err[-3000:]
    assert "afd-vllm ffn: rank 0 stopped" in ffn_out
    assert attention.returncode == 0, attention_err[-3000:]
    report = json.loads(attention_out.strip().splitlines()[-1])
    assert report["error"] in ("PeerAborted", "PeerTimeout", "ConnectorShutdown"), report
    assert "ffn" in report["message"].lower(), report
    # the abort reaches the attention side at once, not at the end of its 30 s receive timeout
    assert report["seconds"] < 20, report
