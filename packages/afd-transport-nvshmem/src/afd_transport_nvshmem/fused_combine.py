# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The fused combine (:mod:`afd_transport_nvshmem.kernel_specs`) as one Triton kernel.

One program per (token, column block): it loads the token's ``k`` wire positions and
weights, finds each reply row in the window (the FFN rank is the number of segment bounds
at or below the wire position), and accumulates ``weight * row`` in fp32 registers; the
shared-expert row of the token is added with weight one. The output is written once in
the activation dtype. A negative wire position (a token that sent nothing to that FFN
rank, in the reduced-reply combine) is skipped. Compared with the portable path this reads
every reply byte once and does no fp32 round trips through memory and no atomics, so the
summation order per token is fixed (choice order) and the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd_transport_nvshmem.kernel_specs import CombineInputs

BLOCK_H = 1024
"""Columns per program: a DeepSeek hidden size (2048, 7168) splits into a few blocks."""


@triton.jit
def _fused_combine_kernel(
    rows,
    routed_starts,
    shared_starts,
    segment_offsets,
    wire_position,
    weights,
    out,
    hidden,
    num_ffn,
    TOPK: tl.constexpr,
    FFN_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < hidden
    ranks = tl.arange(0, FFN_BLOCK)
    # Inner bounds segment_offsets[1 .. F-1]; padding compares as "above every position".
    bounds = tl.load(segment_offsets + 1 + ranks, mask=ranks < num_ffn - 1, other=1 << 62)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        wire = tl.load(wire_position + token * TOPK + j)
        present = wire >= 0  # a negative position contributes nothing (nothing was sent)
        wire = tl.maximum(wire, 0)
        dest = tl.sum((bounds <= wire).to(tl.int32), axis=0)
        first = tl.load(segment_offsets + dest)
        start = tl.load(routed_starts + dest) + (wire - first) * hidden
        weight = tl.load(weights + token * TOPK + j).to(tl.float32)
        value = tl.load(rows + start + columns, mask=in_row & present, other=0.0).to(tl.float32)
        acc += tl.where(present, weight, 0.0) * value
    if HAS_SHARED:
        dest = token % num_ffn
        start = tl.load(shared_starts + dest) + (token // num_ffn) * hidden
        acc += tl.load(rows + start + columns, mask=in_row, other=0.0).to(tl.float32)
    tl.store(out + token * hidden + columns, acc.to(out.dtype.element_ty), mask=in_row)


def triton_fused_combine(inputs: CombineInputs) -> torch.Tensor:
    """:data:`~afd_transport_nvshmem.kernel_specs.FusedCombine` on a CUDA device, on the current
    stream."""
    num_tokens, topk = inputs.topk_weights.shape
    hidden = inputs.hidden_size
    out = torch.empty(num_tokens, hidden, dtype=inputs.out_dtype, device=inputs.rows.device)
    if num_tokens == 0:
        return out
    num_ffn = inputs.routed_starts.numel()
    block = min(BLOCK_H, triton.next_power_of_2(hidden))
    shared = inputs.shared_starts
    _fused_combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        inputs.rows,
        inputs.routed_starts,
        inputs.routed_starts if shared is None else shared,
        inputs.segment_offsets,
        inputs.wire_position,
        inputs.topk_weights.contiguous(),
        out,
        hidden,
        num_ffn,
        TOPK=topk,
        FFN_BLOCK=triton.next_power_of_2(max(1, num_ffn)),
        BLOCK=block,
        HAS_SHARED=shared is not None,
    )
    return out
