"""Attention replicas with a planted fault, for the end-to-end tests of ``afd run``'s
verification (tools/tests/test_run.py puts one in place of
:func:`afd_tools.run.ranks.attention_replica`; the spawned rank processes import it from
here).

Each runs the real replica with :meth:`afd_models.AttentionRoleModel.forward` wrapped, so
that the planted expert choice is what the replica dispatches and records.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from afd_models import (
    AttentionRoleModel,
    FFNRoleExecutor,
    LayerSelect,
    RMSNorm,
    Router,
    Routing,
    Selection,
)
from afd_protocol import Connection, WorkItem
from afd_tools.run import ranks
from afd_tools.run.verify import TIE_MARGIN

Plant = Callable[[int, Selection], torch.Tensor]


def _planted(select: LayerSelect, plant: Plant) -> LayerSelect:
    """``select`` seeing the selection with ``plant``'s ids instead of the router's."""

    def choose(layer: int, selection: Selection) -> torch.Tensor:
        return select(layer, dataclasses.replace(selection, ids=plant(layer, selection)))

    return choose


def _with_plant(plant_for_call: Callable[[int], Plant | None]) -> None:
    """Wrap ``AttentionRoleModel.forward`` in this process: forward number ``n`` (counting
    those with a select hook, i.e. the real steps) routes by ``plant_for_call(n)``."""
    original = AttentionRoleModel.forward
    calls = [0]

    def forward(self: AttentionRoleModel, *args: Any, **options: Any) -> Any:
        select = options.get("select")
        if select is not None:
            plant = plant_for_call(calls[0])
            calls[0] += 1
            if plant is not None:
                options["select"] = _planted(select, plant)
        return original(self, *args, **options)

    AttentionRoleModel.forward = forward  # type: ignore[method-assign]


def wrong_expert_and_nan_replica(connection: Connection, **kwargs: Any) -> dict[str, Any]:
    """In the first step, the batch's first token (request 0's, with one replica and no
    arrival rate) goes to its lowest-scoring expert instead of its k-th at the last MoE
    layer -- far from any tie; and request 1's final hidden state gets a NaN."""
    last = kwargs["config"].moe_layers[-1]

    def worst_for_row_0(layer: int, selection: Selection) -> torch.Tensor:
        ids = selection.ids.clone()
        if layer == last:
            ids[0, -1] = selection.scores[0].argmin()
        return ids

    _with_plant(lambda n: worst_for_row_0 if n == 0 else None)
    out: dict[str, Any] = ranks.attention_replica(connection, **kwargs)
    for result in out.values():
        if 1 in result.last_hidden:
            result.last_hidden[1][0] = math.nan
    return out


def near_tie_replica(connection: Connection, **kwargs: Any) -> dict[str, Any]:
    """Every token whose top-k is within a quarter of the bfloat16 tie margin of a tie (by
    this replica's own scores) takes its (k+1)-th expert instead of its k-th: what another
    rounding could have chosen."""
    threshold = TIE_MARGIN["bfloat16"] / 4

    def swap_near_ties(layer: int, selection: Selection) -> torch.Tensor:
        ids = selection.ids.clone()
        k = ids.shape[1]
        near = selection.near_ties(threshold)
        ids[near, k - 1] = selection.choice.topk(k + 1, dim=-1).indices[near, k]
        return ids

    _with_plant(lambda n: swap_near_ties)
    result: dict[str, Any] = ranks.attention_replica(connection, **kwargs)
    return result


DRIFT = 2e-3
"""How far :func:`drifted_replica` moves every norm's output, elementwise (relative)."""


def drifted_replica(connection: Connection, **kwargs: Any) -> dict[str, Any]:
    """A replica whose RMSNorm outputs are off by up to :data:`DRIFT` per element (a fixed
    pattern rounded to the run's dtype: in bf16 about one element in a hundred is scaled by
    1 - 2^-8, the rest kept): rounding upstream of every router, as other kernels would
    round. Its router and exchange are right on what they are given, so the layer-local
    checks pass, while the reference, on its own states, sees near ties flipped that it
    must follow (4-6 of 70-124 near-tie decisions over seeds 1-4, final states within
    1.4-2.3e-2)."""
    original = RMSNorm.__call__
    patterns: dict[int, torch.Tensor] = {}

    def call(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        out = original(self, x)
        size = out.shape[-1]
        if size not in patterns:
            gen = torch.Generator().manual_seed(size)
            patterns[size] = 1 + DRIFT * (2 * torch.rand(size, generator=gen) - 1)
        return out * patterns[size].to(out.device, out.dtype)

    RMSNorm.__call__ = call  # type: ignore[method-assign]
    result: dict[str, Any] = ranks.attention_replica(connection, **kwargs)
    return result


EXCHANGE_SCALE = 1.03
"""How far off :func:`scaled_exchange_ffn_rank` makes one layer's replies: about the
bf16 tolerance, and small enough to vanish in the final hidden states."""


def scaled_exchange_ffn_rank(connection: Connection, **kwargs: Any) -> dict[str, Any]:
    """An FFN rank whose routed replies at the first MoE layer are :data:`EXCHANGE_SCALE`
    times the experts' output (a wrong weight or scale on the FFN side); every other
    layer is right."""
    first = kwargs["config"].moe_layers[0]
    original = FFNRoleExecutor.compute

    def compute(self: FFNRoleExecutor, item: WorkItem) -> tuple[torch.Tensor, Any]:
        routed, shared = original(self, item)
        if item.layer == first:
            routed = routed * EXCHANGE_SCALE
        return routed, shared

    FFNRoleExecutor.compute = compute  # type: ignore[method-assign]
    result: dict[str, Any] = ranks.ffn_rank(connection, **kwargs)
    return result


WEIGHT_SCALE = 1.01
"""How far off :func:`scaled_weights_replica` makes one layer's expert weights: half the
bf16 tolerance, which the weights are not held to (``ROUTER_WEIGHT_TOLERANCE``)."""


def scaled_weights_replica(connection: Connection, **kwargs: Any) -> dict[str, Any]:
    """A replica whose router weights at the first MoE layer are :data:`WEIGHT_SCALE` times
    what they should be (a wrong routed scale on the attention side): the FFN ranks compute
    exactly what they are sent, so only the weights themselves show it."""
    first = kwargs["config"].moe_layers[0]
    original = Router.__call__

    def call(self: Router, x: torch.Tensor, select: Any = None) -> Routing:
        routing = original(self, x, select)
        if f".layers.{first}." in self.names.get("weight", ""):
            return dataclasses.replace(routing, topk_weights=routing.topk_weights * WEIGHT_SCALE)
        return routing

    Router.__call__ = call  # type: ignore[method-assign]
    result: dict[str, Any] = ranks.attention_replica(connection, **kwargs)
    return result
