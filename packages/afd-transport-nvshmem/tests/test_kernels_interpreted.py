"""The Triton kernels run on the CPU in CI: Triton's interpreter executes the device pack (both
wire formats), the fused combine (per-partial and reduced replies) and the FFN-side reduce,
checked against the torch references (the GPU tests check the compiled
kernels the same way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
import numpy  # noqa: F401 - the interpreter runs on it (a declared test dependency)


def test_every_triton_kernel_matches_its_reference_in_the_interpreter() -> None:
    script = Path(__file__).with_name("afd_interpreted_kernels.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "interpreted kernel cases match their references" in result.stdout
