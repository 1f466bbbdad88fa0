"""Argument handling shared by the model classes."""

from __future__ import annotations

import torch

from afd_models.errors import ConfigError
from afd_models.gemm_check import check_gemms_write_every_output
from afd_models.weights import RandomWeights, WeightSource

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve(
    weights: WeightSource | None, dtype: torch.dtype, device: torch.device | str
) -> tuple[WeightSource, torch.dtype, torch.device]:
    """Default weights (random, seed 0) and checked dtype/device: a CUDA device must pass
    the GEMM probe (:func:`~afd_models.check_gemms_write_every_output`, once per process)
    before a model is built on it."""
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype {dtype} is not supported; use one of {list(SUPPORTED_DTYPES)}")
    where = torch.device(device)
    check_gemms_write_every_output(where)  # e.g. cuBLAS at some CUDA MPS shares
    return (RandomWeights(0) if weights is None else weights), dtype, where
