"""Rotary position embedding with DeepSeek's YaRN scaling.

YaRN (as in the DeepSeek reference implementation) blends two frequency sets per
rotary dimension: the original ``base^(-2i/d)`` for fast-rotating dimensions and the
interpolated ``base^(-2i/d) / factor`` for slow ones, with a linear ramp between the
correction dimensions of ``beta_fast`` and ``beta_slow`` rotations over the original
context. cos/sin are multiplied by ``mscale(factor, mscale) / mscale(factor,
mscale_all_dim)``; the attention softmax scale carries the ``mscale_all_dim`` part
(see :attr:`DeepseekConfig.softmax_scale`).

DeepSeek checkpoints rotate *interleaved* pairs ``(x[2i], x[2i+1])`` (GPT-J style,
``rope_interleave`` true); the half-split (NeoX) layout is supported for configs that
say so. Angles are computed in float32.
"""

from __future__ import annotations

import math

import torch

from afd_models.config import RopeScaling, yarn_get_mscale


def yarn_correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The rotary dimension that completes ``rotations`` turns over ``max_positions``."""
    return (dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, max_positions: int
) -> tuple[int, int]:
    low = math.floor(yarn_correction_dim(beta_fast, dim, base, max_positions))
    high = math.ceil(yarn_correction_dim(beta_slow, dim, base, max_positions))
    return max(low, 0), min(high, dim - 1)


def inverse_frequencies(
    dim: int, base: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] float32, cos/sin multiplier)`` for plain rotary or YaRN."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extrapolated = 1.0 / (base**exponents)
    if scaling is None:
        return extrapolated, 1.0
    interpolated = extrapolated / scaling.factor
    low, high = yarn_correction_range(
        scaling.beta_fast, scaling.beta_slow, dim, base, scaling.original_max_position_embeddings
    )
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    keep = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = interpolated * (1.0 - keep) + extrapolated * keep
    mscale = yarn_get_mscale(scaling.factor, scaling.mscale) / yarn_get_mscale(
        scaling.factor, scaling.mscale_all_dim
    )
    return inv_freq, mscale


class RotaryEmbedding:
    """Applies the rotary embedding of ``dim`` dimensions at given positions."""

    def __init__(
        self,
        dim: int,
        base: float,
        scaling: RopeScaling | None,
        *,
        interleaved: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq, self.mscale = inverse_frequencies(dim, base, scaling)
        self.inv_freq = inv_freq.to(device)
        self.dim = dim
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos``, ``sin`` of shape ``[T, dim/2]`` (already times ``mscale``)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos() * self.mscale, angles.sin() * self.mscale

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, dim]`` (any float dtype; computed in float32)."""
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            x1, x2 = xf.chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
        if self.interleaved:
            out = torch.stack((r1, r2), dim=-1).flatten(-2)
        else:
            out = torch.cat((r1, r2), dim=-1)
        return out.to(x.dtype)
