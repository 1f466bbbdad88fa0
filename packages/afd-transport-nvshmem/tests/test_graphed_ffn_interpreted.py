"""The graphed FFN loop on the CPU in CI: ``afd_interpreted_serve.py``'s cases run in a
subprocess under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before Triton
compiles anything, so they cannot share this process). On a GPU the suite runs the compiled
kernels with real CUDA graphs (``test_graphed_ffn_gpu.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
import numpy  # noqa: F401 - the interpreter runs on it (a declared test dependency)


# The subprocess runs 32 interpreted cases: 70 s alone on the 2-core VM, past the default
# 120 s when make test's two shards share its cores (a clean-clone CI run at 4f5f67a).
@pytest.mark.timeout(600)
def test_the_graphed_ffn_loop_in_the_interpreter() -> None:
    cases = Path(__file__).with_name("afd_interpreted_serve.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-2000:]
    assert "skipped" not in result.stdout, result.stdout[-2000:]
