"""The GEMM start-up probe on a real GPU (afd_models.gemm_check): as a CUDA MPS client at
several SM shares and on the whole GPU, the probe flags the device exactly when an
independent sweep of row counts finds an unwritten bf16 output element."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def _gpu_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


SWEEP = """
import json, torch
from afd_models.gemm_check import PROBE_SHAPES, unwritten_outputs
bad = 0
for k, n in PROBE_SHAPES:
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    x = torch.randn(1200, k, device="cuda").to(torch.bfloat16)
    for m in range(1, 1200, 3):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        torch.mm(x[:m], w.t(), out=out)
        bad += int(torch.isnan(out).any())
print(json.dumps({"sweep": bad, "probe": unwritten_outputs("cuda")}))
"""


def _sweep(share: int | None) -> dict[str, object]:
    """The sweep and the probe, as an MPS client at ``share`` % (None: the whole GPU)."""
    from afd_transport_nvshmem.mps import MpsDaemon

    with MpsDaemon.start() as daemon:
        env = {**os.environ, **(daemon.client_environment(share) if share else {})}
        result = subprocess.run(
            [sys.executable, "-c", SWEEP], env=env, capture_output=True, text=True, timeout=240
        )
    assert result.returncode == 0, result.stderr[-3000:]
    seen: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return seen


def _probe_agrees(seen: dict[str, object]) -> None:
    """The probe flags bf16 exactly when the sweep found an unwritten bf16 element."""
    probe = seen["probe"]
    assert isinstance(probe, list)
    bf16_probe = [line for line in probe if line.startswith("bfloat16")]
    assert bool(seen["sweep"]) == bool(bf16_probe), seen


# 33 % (refused on an H200) is checked by the refusal test below, from the same sweep.
@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(_gpu_missing() is not None, reason=_gpu_missing() or "")
@pytest.mark.parametrize("share", [None, 25, 50])
def test_the_probe_agrees_with_a_sweep_on_this_gpu(share: int | None) -> None:
    """As an MPS client at ``share`` % (or the whole GPU): the probe flags the device
    exactly when a sweep of 400 row counts per shape finds an unwritten bf16 element."""
    _probe_agrees(_sweep(share))


SMALL_RUN = [
    "run", "--device", "cuda", "--share-gpus", "--requests", "4", "--max-prompt-len", "64",
    "--max-num-batched-tokens", "128", "--attention-ranks", "1", "--ffn-ranks", "1",
    "--mode", "async", "--no-progress",
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(_gpu_missing() is not None, reason=_gpu_missing() or "")
def test_afd_run_refuses_a_share_whose_gemms_drop_outputs_before_any_work() -> None:
    """At 33 % (42 SMs of an H200, where the sweep finds cuBLAS dropping outputs) the probe
    agrees with the sweep, and afd run stops at start-up naming the share and what to
    change; where the sweep finds nothing at 33 % the run must pass instead."""
    seen = _sweep(33)
    _probe_agrees(seen)
    faulty = bool(seen["sweep"])
    argv = [*SMALL_RUN, "--mps-attention-share", "33", "--mps-ffn-share", "33"]
    result = subprocess.run(
        [sys.executable, "-m", "afd_tools.cli", *argv], capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    output = result.stdout + result.stderr
    if not faulty:
        assert result.returncode == 0, output[-3000:]
        return
    assert result.returncode != 0, output[-3000:]
    assert "a CUDA MPS client at 33 %" in output, output[-3000:]
    assert "leaves output elements unwritten" in output, output[-3000:]
    assert "use another SM share" in output, output[-3000:]
