# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""A graphed dispatch's inputs fetched by address inside the graph, in one launch
(:data:`~afd_transport_nvshmem.kernel_specs.InputFetch`; its reference is
:func:`~afd_transport_nvshmem.kernel_specs.reference_fetch_inputs`).

A CUDA graph reads its inputs at fixed addresses, so each replayed dispatch used to start
with three host launches copying the layer's hidden states, expert ids and weights into
the graph's buffers (about 13 µs of host time each on one H200). Instead the host writes
the three source addresses into page-locked memory; the graph copies them to the device
(a word-copy kernel) and ``_fetch_kernel`` copies the bytes (one kernel node); where no
shared rows go to the FFN ranks, only the ids and weights (a zero-size destination skips a
source), and the device pack reads the rows where the caller left them
(:attr:`~afd_transport_nvshmem.kernel_specs.PackInputs.hidden_address`). Sources must
be contiguous and stay alive until the replay ran; the endpoint guarantees both (it copies
a non-contiguous input into the graph's own buffer, and holds every fetched tensor until
the graph's next dispatch, after its ring was combined).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
"""Half-words (2 bytes) per program and source."""


@triton.jit(do_not_specialize=["n0", "n1", "n2"])
def _fetch_kernel(sources, dst0, dst1, dst2, n0, n1, n2, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    src0 = tl.load(sources).to(tl.pointer_type(tl.int16))
    src1 = tl.load(sources + 1).to(tl.pointer_type(tl.int16))
    src2 = tl.load(sources + 2).to(tl.pointer_type(tl.int16))
    tl.store(dst0 + offsets, tl.load(src0 + offsets, mask=offsets < n0), mask=offsets < n0)
    tl.store(dst1 + offsets, tl.load(src1 + offsets, mask=offsets < n1), mask=offsets < n1)
    tl.store(dst2 + offsets, tl.load(src2 + offsets, mask=offsets < n2), mask=offsets < n2)


def _half_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as int16 (every input here is a whole number of 2-byte words)."""
    flat = t.view(-1).view(torch.uint8)
    if flat.numel() % 2:
        raise ValueError(f"a fetched input must hold an even number of bytes, got {t.dtype}")
    return flat.view(torch.int16)


def triton_fetch_inputs(sources: torch.Tensor, destinations: list[torch.Tensor]) -> None:
    """Copy into each of the three contiguous ``destinations`` as many bytes from the
    address in ``sources`` (int64 ``[3]`` on the destinations' device), on the current
    stream, in one launch."""
    if len(destinations) != 3:
        raise ValueError(f"fetch takes three destinations, got {len(destinations)}")
    words = [_half_words(d) for d in destinations]
    largest = max(w.numel() for w in words)
    _fetch_kernel[(max(1, triton.cdiv(largest, BLOCK)),)](
        sources, *words, *(w.numel() for w in words), BLOCK=BLOCK
    )
