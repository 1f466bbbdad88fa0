"""RMSNorm, computed in float32 and returned in the input dtype (as the reference does)."""

from __future__ import annotations

import torch


class RMSNorm:
    """``weight * x / sqrt(mean(x^2) + eps)``; the statistics are taken in float32."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
