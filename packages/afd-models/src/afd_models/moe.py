"""The colocated MoE layer: router, shared experts and every routed expert in one place.

This is what the monolithic reference runs. The routed branch takes the same route as
on an FFN rank -- rows sorted by expert into a grouped work item, computed by an expert
backend with unit weight -- and the top-k weights (times the routed scale) are applied
afterwards in a float32 weighted scatter, as the attention side's combine does.
"""

from __future__ import annotations

import torch

from afd_models.backends import ExpertBackend
from afd_models.config import DeepseekConfig
from afd_models.experts import ExpertWeights, GroupedRows
from afd_models.mlp import GatedMLP
from afd_models.router import Router, Select, Selection
from afd_models.scaling import BranchScales


def group_by_expert(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, row_token, group_list)`` for routing ``topk_ids [T, k]`` to local experts.

    ``order`` lists flat ``(token, choice)`` indices grouped by expert (stable, so token
    order within an expert); ``row_token`` is each grouped row's token; ``group_list``
    counts rows per expert.
    """
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    row_token = torch.div(order, k, rounding_mode="floor")
    group_list = torch.bincount(flat, minlength=num_experts)
    return order, row_token, group_list


def routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: ExpertWeights,
    backend: ExpertBackend,
) -> torch.Tensor:
    """``sum_j w_j * expert_{ids_j}(x)`` per token, accumulated in float32, in ``x.dtype``.

    ``experts`` must hold every expert ``topk_ids`` names, with local id = global id.
    """
    order, row_token, group_list = group_by_expert(topk_ids, experts.num_local_experts)
    rows = x.index_select(0, row_token)
    outputs = backend(GroupedRows(rows, group_list), experts)
    weights = topk_weights.reshape(-1).index_select(0, order).float()
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    acc.index_add_(0, row_token, outputs.float().mul_(weights[:, None]))
    return acc.to(x.dtype)


class MoELayer:
    """One colocated MoE layer (see the module docstring)."""

    def __init__(
        self,
        config: DeepseekConfig,
        router: Router,
        shared: GatedMLP | None,
        experts: ExpertWeights,
        backend: ExpertBackend,
    ) -> None:
        if experts.expert_ids != tuple(range(config.n_routed_experts)):
            raise ValueError("a colocated MoE layer holds every routed expert, by global id")
        self.config = config
        self.router = router
        self.shared = shared
        self.experts = experts
        self.backend = backend

    def exchanged(
        self, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor, *, with_shared: bool
    ) -> torch.Tensor:
        """What the AFD exchange returns for rows ``x [t, H]`` routed to ``topk_ids``
        (int64 ``[t, k]``) with ``weights`` (float32 ``[t, k]``, the routed scale applied):
        the weighted routed experts, plus the shared experts ``with_shared`` (when they run on
        the FFN ranks). ``[t, H]`` in ``x.dtype``, on this layer's device: the reference an
        observed exchange (:data:`afd_models.attention_role.ExchangeObserver`) is checked
        against, computed as :meth:`__call__` computes it."""
        out = routed_experts(x, topk_ids, weights, self.experts, self.backend)
        if with_shared and self.shared is not None:
            scales = BranchScales.for_dtype(self.config.routed_scaling_factor, x.dtype)
            shared = self.shared(x)
            out = out + (shared * scales.shared if scales.shared != 1.0 else shared)
        return out

    def routed_weights(
        self, x: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[Selection, torch.Tensor]:
        """The router's :class:`~afd_models.router.Selection` for rows ``x [t, H]`` (its own
        top-k and tie gaps) and the weights it gives the experts ``topk_ids`` (int64
        ``[t, k]``, whichever were chosen): float32 ``[t, k]`` on this layer's device, the
        routed scale applied, as :meth:`__call__` weights its own choice. What an observed
        exchange's routing is checked against."""
        seen: list[Selection] = []

        def keep(selection: Selection) -> torch.Tensor:
            seen.append(selection)
            return topk_ids.to(device=selection.ids.device, dtype=selection.ids.dtype)

        routing = self.router(x, keep)
        scales = BranchScales.for_dtype(self.config.routed_scaling_factor, x.dtype)
        return seen[0], routing.topk_weights * scales.routed

    def __call__(self, x: torch.Tensor, select: Select | None = None) -> torch.Tensor:
        """The MoE output ``[T, H]`` (``x.dtype``) of ``x [T, H]``; ``select`` is the
        router's hook (:class:`~afd_models.router.Selection`)."""
        scales = BranchScales.for_dtype(self.config.routed_scaling_factor, x.dtype)
        routing = self.router(x, select)
        weights = routing.topk_weights * scales.routed
        out = routed_experts(x, routing.topk_ids, weights, self.experts, self.backend)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared * scales.shared if scales.shared != 1.0 else shared)
        return out
