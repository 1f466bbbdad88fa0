"""The Triton kernels run on the CPU in CI: Triton's interpreter executes the device pack (both
wire formats), the fused combine (per-partial and reduced replies), the FFN-side reduce and
the device plan, checked against the torch references (the GPU tests check the compiled
kernels the same way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
import numpy  # noqa: F401 - the interpreter runs on it (a declared test dependency)


def _interpreted(script: str, *args: str) -> str:
    """Run ``script`` (beside this file) with ``TRITON_INTERPRET=1``; its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize(("group", "cases"), [("exchange", 13), ("pack", 36), ("combine", 42)])
def test_every_triton_kernel_matches_its_reference_in_the_interpreter(
    group: str, cases: int
) -> None:
    """One interpreter run per group of kernels (each well inside the per-test timeout on a
    slow CI machine); the case count proves the group ran every case."""
    assert f"{group}: {cases} interpreted kernel cases match their references" in _interpreted(
        "afd_interpreted_kernels.py", group
    )


def test_the_triton_device_plan_equals_plan_on_device_in_the_interpreter() -> None:
    """``afd_transport_nvshmem.device_plan`` field for field against ``plan_on_device``:
    both wire formats, with and without the partial order, empty batches, ids out of range,
    long runs of one expert, V2-Lite and V3 shapes past one scan chunk."""
    assert "79 interpreted device plan cases equal plan_on_device" in _interpreted(
        "afd_interpreted_plan.py"
    )
