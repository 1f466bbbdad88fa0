"""The SiLU-gated MLP used by dense layers and by the shared experts."""

from __future__ import annotations

import torch
from torch.nn import functional as nnf

from afd_models.params import ParamSpec
from afd_models.weights import WeightSource


class GatedMLP:
    """``down(silu(gate(x)) * up(x))`` with Hugging Face weight layout ``[out, in]``."""

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> None:
        self.gate = gate
        self.up = up
        self.down = down
        self.names = names

    @classmethod
    def load(
        cls,
        specs: dict[str, ParamSpec],
        source: WeightSource,
        dtype: torch.dtype,
        device: torch.device,
    ) -> GatedMLP:
        parts = (specs["gate_proj"], specs["up_proj"], specs["down_proj"])
        gate, up, down = (source.get(spec, dtype, device) for spec in parts)
        return cls(gate, up, down, (parts[0].name, parts[1].name, parts[2].name))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return nnf.linear(nnf.silu(nnf.linear(x, self.gate)) * nnf.linear(x, self.up), self.down)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights by checkpoint name."""
        return dict(zip(self.names, (self.gate, self.up, self.down), strict=True))
