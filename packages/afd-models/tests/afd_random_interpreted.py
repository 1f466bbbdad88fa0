"""Run afd_models.device_random's Triton kernel on the CPU through Triton's interpreter
(started by test_device_random.py with TRITON_INTERPRET=1, which must be set before Triton
compiles anything); prints one line per check and "device random: ok" at the end."""

from __future__ import annotations

import os
import sys

import torch

from afd_models import device_random


def draw(n: int, seed: int, block: int | None = None, chunk: int | None = None) -> torch.Tensor:
    old_block, old_chunk = device_random.BLOCK, device_random.CHUNK
    device_random.BLOCK = block or old_block
    device_random.CHUNK = chunk or old_chunk
    try:
        return device_random.normal_(torch.empty(n, dtype=torch.float32), seed)
    finally:
        device_random.BLOCK, device_random.CHUNK = old_block, old_chunk


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    a = draw(5000, seed=12345)
    # another block size is another grid: what a process with another SM share launches
    assert torch.equal(a, draw(5000, seed=12345, block=256)), "values depend on the grid"
    assert torch.equal(draw(3000, seed=12345), a[:3000]), "a prefix differs"
    assert not torch.equal(draw(5000, seed=12346), a), "the seed is ignored"
    values = draw(1 << 16, seed=7)
    assert bool(torch.isfinite(values).all()), "non-finite values"
    assert abs(float(values.mean())) < 0.02, float(values.mean())
    assert abs(float(values.std()) - 1.0) < 0.02, float(values.std())
    chunked = draw(4096, seed=3, chunk=2048)
    assert not torch.equal(chunked[:2048], chunked[2048:]), "chunks repeat"
    assert torch.equal(chunked[:2048], draw(2048, seed=3)), "the first chunk moved"
    print("device random: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
