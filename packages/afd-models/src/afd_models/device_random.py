"""Standard normal values on a GPU that depend on (seed, element index) alone.

``torch.randn`` on CUDA sizes its grid by the device's multiprocessor count and gives each
thread a stride of that grid, so the same seed yields *different values* in processes that
see different SM counts -- which is what a CUDA MPS share does (a client limited to 50 % of
an H200 sees 66 SMs instead of 132). Ranks sharing a GPU under MPS with different shares,
or a reference model on the whole GPU beside them, would then hold different random
weights: measured on one H200, the monolithic model's output drawn at a 50 % share differed
from the full-GPU one by 140 % (relative), and at 33 % it was NaN.

:func:`normal_` draws with Triton's counter-based Philox (``tl.randn(seed, offset)``), so
every element is a function of the seed and its index only, whatever the grid, the SM
count or the block size. CPU tensors keep ``torch.randn`` (the same values on every
machine).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from afd_models.errors import WeightsError

BLOCK = 1024
CHUNK = 1 << 30
"""Elements per launch (offsets stay below 2**31); each chunk has a seed of its own."""

_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            raise WeightsError(
                "random weights drawn on a GPU need Triton (it ships with CUDA builds of "
                "torch): install triton, or draw them on the CPU (device='cpu')"
            ) from None

        @triton.jit  # type: ignore[untyped-decorator]
        def randn_kernel(out_ptr, n, seed, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            values = tl.randn(seed, offsets)
            tl.store(out_ptr + offsets, values, mask=offsets < n)

        _KERNEL = (triton, randn_kernel)
    return _KERNEL


def chunk_seed(seed: int, chunk: int) -> int:
    """The Philox key of chunk ``chunk`` of a tensor drawn with ``seed`` (a stable 31-bit
    hash of both, so every bit of a 63-bit seed counts)."""
    digest = hashlib.blake2b(f"{seed}\0{chunk}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


def normal_(out: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill the contiguous float32 CUDA tensor ``out`` (any shape) with N(0, 1) values that
    depend only on ``seed`` and each element's flat index (module docstring); returns
    ``out``."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"normal_ fills a contiguous float32 tensor, got {out.dtype}")
    triton, kernel = _kernel()
    flat = out.view(-1)
    for chunk, start in enumerate(range(0, flat.numel(), CHUNK)):
        part = flat[start : start + CHUNK]
        grid = (triton.cdiv(part.numel(), BLOCK),)
        kernel[grid](part, part.numel(), chunk_seed(seed, chunk), BLOCK=BLOCK)
    return out
