"""GPU random weights that depend on (seed, index) alone, not on the grid a process launches
(which follows its SM count, hence its CUDA MPS share): the Triton kernel runs on the CPU
under Triton's interpreter, in a subprocess (skipped without Triton)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from afd_models import device_random


def test_the_kernel_is_grid_independent_standard_normal_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # the interpreter runs on NumPy
    script = Path(__file__).with_name("afd_random_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "device random: ok" in done.stdout


def test_only_contiguous_float32() -> None:
    with pytest.raises(ValueError, match="contiguous float32"):
        device_random.normal_(torch.empty(4, dtype=torch.float64), 0)


def test_chunk_seeds_are_distinct_31_bit_keys() -> None:
    keys = {device_random.chunk_seed(s, c) for s in (0, 1, 2**62) for c in range(4)}
    assert len(keys) == 12
    assert all(0 <= k < 2**31 for k in keys)
