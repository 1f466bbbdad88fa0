"""Argument handling shared by the model classes."""

from __future__ import annotations

import torch

from afd_models.errors import ConfigError
from afd_models.weights import RandomWeights, WeightSource

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve(
    weights: WeightSource | None, dtype: torch.dtype, device: torch.device | str
) -> tuple[WeightSource, torch.dtype, torch.device]:
    """Default weights (random, seed 0) and checked dtype/device."""
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype {dtype} is not supported; use one of {list(SUPPORTED_DTYPES)}")
    return (RandomWeights(0) if weights is None else weights), dtype, torch.device(device)
