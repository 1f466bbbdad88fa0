"""NVSHMEM's put-with-signal and signal wait through the ctypes binding, on one GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_put_with_signal_lands_the_payload_then_the_signal() -> None:
    script = Path(__file__).with_name("afd_put_signal_one_pe.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "put-with-signal one-PE checks passed" in result.stdout
    print(result.stdout)
