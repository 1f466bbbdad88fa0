"""Routed experts held by one rank, and the grouped rows they are computed on.

The experts of one MoE layer are stacked by *local* id (``gate_up [E, 2I, H]``: gate
rows then up rows; ``down [E, H, I]``), the layout grouped GEMMs want. The rows arrive
already grouped by local expert in ascending order with a group list (rows per local
expert) -- from a work item on an FFN rank, or from the local sort in the monolithic
model. Nothing here routes: a backend expands the group list to one local expert id per
row and applies each expert with unit weight; the top-k weights stay with the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from afd_models.config import DeepseekConfig
from afd_models.params import ModelParams
from afd_models.weights import WeightSource
from afd_protocol import expert_ids_from_counts


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's routed experts on one rank, stacked by local id."""

    layer: int
    expert_ids: tuple[int, ...]
    """Global id of each local expert."""
    gate_up: torch.Tensor
    """``[E_local, 2 * I, H]``: ``gate_proj`` rows, then ``up_proj`` rows."""
    down: torch.Tensor
    """``[E_local, H, I]``."""

    @property
    def num_local_experts(self) -> int:
        return len(self.expert_ids)

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[-1]

    @classmethod
    def load(
        cls,
        config: DeepseekConfig,
        layer: int,
        expert_ids: Sequence[int],
        source: WeightSource,
        dtype: torch.dtype,
        device: torch.device,
    ) -> ExpertWeights:
        """Read the given experts one tensor at a time into preallocated stacks."""
        ids = tuple(expert_ids)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        gate_up = torch.empty(len(ids), 2 * inter, hidden, dtype=dtype, device=device)
        down = torch.empty(len(ids), hidden, inter, dtype=dtype, device=device)
        return cls.load_into(gate_up, down, config, layer, ids, source)

    @classmethod
    def load_into(
        cls,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        config: DeepseekConfig,
        layer: int,
        expert_ids: Sequence[int],
        source: WeightSource,
    ) -> ExpertWeights:
        """Read the given experts into ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (given,
        e.g. one layer's slice of an :class:`ExpertStack`), one tensor at a time."""
        ids = tuple(expert_ids)
        inter = config.moe_intermediate_size
        params = ModelParams(config)
        dtype, device = gate_up.dtype, gate_up.device
        for local, expert in enumerate(ids):
            specs = params.expert(layer, expert)
            gate_up[local, :inter].copy_(source.get(specs["gate_proj"], dtype, device))
            gate_up[local, inter:].copy_(source.get(specs["up_proj"], dtype, device))
            down[local].copy_(source.get(specs["down_proj"], dtype, device))
        return cls(layer, ids, gate_up, down)

    def tensors(self, config: DeepseekConfig) -> dict[str, torch.Tensor]:
        """Per-expert views by checkpoint name."""
        params = ModelParams(config)
        inter = self.intermediate_size
        out = {}
        for local, expert in enumerate(self.expert_ids):
            specs = params.expert(self.layer, expert)
            out[specs["gate_proj"].name] = self.gate_up[local, :inter]
            out[specs["up_proj"].name] = self.gate_up[local, inter:]
            out[specs["down_proj"].name] = self.down[local]
        return out


@dataclass(frozen=True)
class ExpertStack:
    """One rank's routed experts of every MoE layer in two allocations, indexed by the
    layer's position among the MoE layers; each layer's :class:`ExpertWeights` is a view.
    A kernel that reads the layer index on the device (the ``triton`` backend's grouped
    GEMM) selects a layer without a copy, so a CUDA graph can serve any layer."""

    moe_layers: tuple[int, ...]
    """Model layer of each stack position."""
    expert_ids: tuple[int, ...]
    gate_up: torch.Tensor
    """``[L_moe, E_local, 2 * I, H]``."""
    down: torch.Tensor
    """``[L_moe, E_local, H, I]``."""

    @classmethod
    def load(
        cls,
        config: DeepseekConfig,
        expert_ids: Sequence[int],
        source: WeightSource,
        dtype: torch.dtype,
        device: torch.device,
    ) -> ExpertStack:
        layers = tuple(config.moe_layers)
        ids = tuple(expert_ids)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        shape = (len(layers), len(ids))
        gate_up = torch.empty(*shape, 2 * inter, hidden, dtype=dtype, device=device)
        down = torch.empty(*shape, hidden, inter, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            ExpertWeights.load_into(gate_up[i], down[i], config, layer, ids, source)
        return cls(layers, ids, gate_up, down)

    def position(self, layer: int) -> int:
        """The stack position of model layer ``layer`` (``KeyError`` if not an MoE layer)."""
        try:
            return self.moe_layers.index(layer)
        except ValueError:
            raise KeyError(
                f"layer {layer} is not an MoE layer (MoE layers: {list(self.moe_layers)})"
            ) from None

    def layer(self, layer: int) -> ExpertWeights:
        """Model layer ``layer``'s experts: views into the stack."""
        i = self.position(layer)
        return ExpertWeights(layer, self.expert_ids, self.gate_up[i], self.down[i])


@dataclass(frozen=True)
class GroupedRows:
    """Rows grouped by local expert (ascending), with the group list."""

    rows: torch.Tensor
    """``[N, H]``."""
    group_list: torch.Tensor
    """int64 ``[E_local]``: rows per local expert; sums to ``N``."""

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def expert_ids(self) -> torch.Tensor:
        """One local expert id per row, expanded from the group list."""
        counts = self.group_list.to(self.rows.device)
        return expert_ids_from_counts(counts, self.num_rows)

    def unit_weights(self) -> torch.Tensor:
        """float32 ``[N, 1]`` ones: each row is one expert's input, with weight one."""
        return torch.ones(self.num_rows, 1, dtype=torch.float32, device=self.rows.device)
