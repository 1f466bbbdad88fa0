"""A whole layer's combine in one pass: the interface a transport's device kernel implements.

The portable combine (:func:`~afd_protocol.plan.combine_scatter`, once per FFN rank) widens
every reply row to fp32, weights it and adds it into an fp32 accumulator with atomics: on
a GPU that is several passes over the reply bytes and a dozen launches per layer. A fused
combine reads each token's ``k`` reply rows straight out of the window where they landed,
weights them in registers and writes the output once.

Everything it needs is described by positions in this rank's window, so a backend kernel
takes plain tensors and never sees the endpoint:

* ``rows`` -- the local window viewed as a flat tensor of the activation dtype;
* ``routed_starts[d]`` -- the element offset in ``rows`` of FFN rank ``d``'s reply rows
  (``shared_starts[d]`` likewise for shared-expert rows, ``None`` when the attention side
  computes the shared experts);
* ``segment_offsets`` -- the plan's segment bounds (``[F + 1]``, int64, on the device): wire
  position ``i`` belongs to FFN rank ``d`` when ``segment_offsets[d] <= i < ...[d + 1]``
  and is that rank's reply row ``i - segment_offsets[d]``;
* ``wire_position`` -- the plan's wire position of each partial ``t * k + j``;
* shared rows follow the round-robin split of :func:`~afd_protocol.plan.plan_dispatch`:
  token ``t`` is FFN rank ``t % F``'s shared row ``t // F``.

:func:`reference_fused_combine` is the same computation in torch, the specification a
kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CombineInputs:
    """Everything a fused combine reads, as positions in the local window (module docstring)."""

    rows: torch.Tensor
    routed_starts: torch.Tensor
    shared_starts: torch.Tensor | None
    segment_offsets: torch.Tensor
    wire_position: torch.Tensor
    topk_weights: torch.Tensor
    hidden_size: int
    out_dtype: torch.dtype


FusedCombine = Callable[[CombineInputs], torch.Tensor]
"""``out[t] = sum_j w[t, j] * reply(t, j) (+ shared(t))``, accumulated in fp32."""


def reference_fused_combine(inputs: CombineInputs) -> torch.Tensor:
    """The fused combine written with torch ops (see the module docstring)."""
    rows, hidden = inputs.rows, inputs.hidden_size
    num_tokens, topk = inputs.topk_weights.shape
    num_ffn = inputs.routed_starts.numel()
    columns = torch.arange(hidden, device=rows.device)
    wire, bounds = inputs.wire_position, inputs.segment_offsets
    dest = torch.bucketize(wire, bounds[1:-1], right=True)
    starts = inputs.routed_starts[dest] + (wire - bounds[dest]) * hidden
    values = rows[starts[:, None] + columns].float().view(num_tokens, topk, hidden)
    out = (values * inputs.topk_weights.float()[..., None]).sum(dim=1)
    if inputs.shared_starts is not None:
        tokens = torch.arange(num_tokens, device=rows.device)
        shared = inputs.shared_starts[tokens % num_ffn] + (tokens // num_ffn) * hidden
        out += rows[shared[:, None] + columns].float()
    return out.to(inputs.out_dtype)
