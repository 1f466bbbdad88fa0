# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The FFN-side reduce of ``per_rank`` partials
(:data:`afd_protocol.PartialsReduce`) as one Triton kernel.

The torch reference widens every expert output to fp32, scatters it into a zeroed
``[R * k, H]`` fp32 buffer at its (row, choice) slot and multiplies by the weights: five
passes over several times the output's bytes. Here one program per (token row, column
block) reads the row's ``k`` partials where the experts wrote them (the slot-to-partial
map, ``-1`` for a choice on another rank, is the inverse of the expansion order),
weights them in fp32 registers in choice order and writes the reduced row once.
Deterministic: the summation order per row is fixed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd_protocol import PartialsToReduce

BLOCK_H = 1024


@triton.jit
def _reduce_partials_kernel(
    out,
    partial_of_slot,
    route_weights,
    reduced,
    hidden,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        partial = tl.load(partial_of_slot + row * TOPK + j)
        present = partial >= 0
        weight = tl.where(present, tl.load(route_weights + row * TOPK + j).to(tl.float32), 0.0)
        start = tl.maximum(partial, 0) * hidden
        value = tl.load(out + start + columns, mask=in_row & present, other=0.0).to(tl.float32)
        acc += weight * value
    tl.store(reduced + row * hidden + columns, acc.to(reduced.dtype.element_ty), mask=in_row)


def triton_reduce_partials(inputs: PartialsToReduce) -> torch.Tensor:
    """:data:`afd_protocol.PartialsReduce` on a CUDA device, on the current stream."""
    out = inputs.out.contiguous()
    rows, topk = inputs.route_ids.shape
    hidden = out.shape[1]
    device = out.device
    reduced = torch.empty(rows, hidden, dtype=out.dtype, device=device)
    if rows == 0:
        return reduced
    slots = inputs.slots.to(device)
    partial_of_slot = torch.full((rows * topk,), -1, dtype=torch.int64, device=device)
    partial_of_slot.scatter_(0, slots, torch.arange(slots.numel(), device=device))
    block = min(BLOCK_H, triton.next_power_of_2(hidden))
    _reduce_partials_kernel[(rows, triton.cdiv(hidden, block))](
        out,
        partial_of_slot,
        inputs.route_weights.to(device, torch.float32).contiguous(),
        reduced,
        hidden,
        TOPK=topk,
        BLOCK=block,
    )
    return reduced
