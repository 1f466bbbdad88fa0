"""CAM's dynamic int8 quantisation of dispatched rows: one fp32 scale per token.

In fp32, per token: ``s = 127 / max|x|``, ``q = round_half_even(x * s)`` (the NPU goes
fp32 -> int32 -> half -> int8; every value is within [-127, 127], so the chain is exact),
and the stored dequantisation scale is ``1 / s`` (about ``amax / 127``). Dequantised,
each element is off by at most half a step: ``|x - q / s| <= amax / 254``.

An all-zero row makes the NPU kernel divide by zero (scale ``inf``, undefined int8); here
it quantises to zeros with scale 0 -- a deliberate, documented deviation.
"""

from __future__ import annotations

import torch

QMAX = 127.0


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [T, H], scale fp32 [T])`` with ``x ~= q * scale[:, None]``."""
    values = x.float()
    amax = values.abs().amax(dim=1) if values.shape[1] else values.new_zeros(values.shape[0])
    step = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    q = torch.round(values * step[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    scale = torch.where(amax > 0, 1.0 / step, torch.zeros_like(amax))
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` per row, in fp32, returned in ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)
