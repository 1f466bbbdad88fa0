"""Expert choices for ``afd run``'s verification: what a replica routed, and the reference's
tie-aware routing hook.

Both are :data:`afd_models.LayerSelect` hooks. :class:`RoutingLog` runs in the rank
processes: it keeps the router's own choice and records it, so a replica returns, per
step, every token's top-k expert ids at every MoE layer. :class:`TieFollower` runs in the
reference replay of one step: it keeps the reference's own choice, except at tokens whose
top-k is within a margin of a tie (:meth:`afd_models.Selection.near_ties`), where it takes
the run's choice if that differs; it records where it did, and where the run chose
differently with no near tie (a wrong expert).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from afd_models import Selection


class RoutingError(RuntimeError):
    """A replica's routing record does not fit the step the reference replays."""


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool ``[T]``: tokens whose top-k expert *sets* differ (``a``, ``b``: ids ``[T, k]``)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


class RoutingLog:
    """Records the router's own top-k of every MoE layer of one forward (stages in order).

    :meth:`take` returns the record on the CPU and starts the next one; until then the
    ids stay where the router made them, so recording adds no device synchronisation
    inside a timed step.
    """

    def __init__(self, moe_layers: Sequence[int]) -> None:
        self.moe_layers = tuple(moe_layers)
        self._pieces: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, selection: Selection) -> torch.Tensor:
        self._pieces.setdefault(layer, []).append(selection.ids)
        return selection.ids

    def take(self) -> torch.Tensor:
        """int32 ``[moe layers, T, k]`` on the CPU (layers in ``moe_layers`` order), the
        forwards since the last take; raises :class:`RoutingError` if a layer is missing."""
        missing = [layer for layer in self.moe_layers if layer not in self._pieces]
        if missing:
            raise RoutingError(f"no routing was recorded for MoE layers {missing}")
        layers = [torch.cat(self._pieces[layer]) for layer in self.moe_layers]
        self._pieces = {}
        return torch.stack(layers).to(torch.int32).cpu()


class TieFollower:
    """The reference's routing hook for one replayed step (see the module docstring).

    ``run`` is the replica's record of the step (int32 ``[moe layers, T, k]``, CPU), or
    ``None`` to route as the reference's own router does. After the forward, the
    ``[moe layers, T]`` CPU records tell, per layer and token: ``gaps`` (float32, the
    reference's relative tie gap), ``near`` (within that layer's ``margin``: one for every
    MoE layer, or one per MoE layer), ``followed`` (near, and the
    run chose otherwise: the reference took the run's choice) and ``wrong`` (the run chose
    otherwise with no near tie); ``own`` (int32 ``[moe layers, T, k]``) is the reference's
    own choice and ``run`` the replica's.
    """

    def __init__(
        self, moe_layers: Sequence[int], margin: float | Sequence[float], run: torch.Tensor | None
    ) -> None:
        self.moe_layers = tuple(moe_layers)
        margins = [margin] * len(self.moe_layers) if isinstance(margin, float | int) else margin
        if len(margins) != len(self.moe_layers):
            raise ValueError(
                f"{len(margins)} tie margins for {len(self.moe_layers)} MoE layers; give one "
                "per MoE layer, or one for all"
            )
        self.margins = tuple(float(m) for m in margins)
        """The tie margin at each MoE layer (``moe_layers`` order)."""
        self.run = run
        self._records: dict[str, list[torch.Tensor]] = {
            "own": [],
            "gaps": [],
            "near": [],
            "followed": [],
            "wrong": [],
        }

    def __call__(self, layer: int, selection: Selection) -> torch.Tensor:
        own = selection.ids
        index = len(self._records["own"])
        if index >= len(self.moe_layers) or self.moe_layers[index] != layer:
            raise RoutingError(
                f"the reference routed layer {layer} where MoE layer "
                f"{self.moe_layers[index] if index < len(self.moe_layers) else 'none'} was due; "
                f"replay each step in one stage"
            )
        gaps = selection.tie_gaps()
        near = gaps <= self.margins[index]
        differ = torch.zeros_like(near)
        chosen = own
        if self.run is not None:
            run = self._run_ids(index, own)
            differ = differs(run, own)
            follow = differ & near
            chosen = torch.where(follow[:, None], run, own)
        self._record(own, gaps, near, differ)
        return chosen

    def _run_ids(self, index: int, own: torch.Tensor) -> torch.Tensor:
        """The run's ids ``[T, k]`` of MoE layer number ``index``, as the router's."""
        assert self.run is not None
        if self.run.shape[0] != len(self.moe_layers) or self.run.shape[1:] != own.shape:
            raise RoutingError(
                f"the replica recorded routing of shape {tuple(self.run.shape)} for a step the "
                f"reference routes as {len(self.moe_layers)} MoE layers x {tuple(own.shape)}"
            )
        return self.run[index].to(device=own.device, dtype=own.dtype)

    def _record(
        self, own: torch.Tensor, gaps: torch.Tensor, near: torch.Tensor, differ: torch.Tensor
    ) -> None:
        r = self._records
        r["own"].append(own.to(torch.int32).cpu())
        r["gaps"].append(gaps.float().cpu())
        r["near"].append(near.cpu())
        r["followed"].append((differ & near).cpu())
        r["wrong"].append((differ & ~near).cpu())

    def record(self, name: str) -> torch.Tensor:
        """One of the records named in the class docstring, stacked over the MoE layers."""
        pieces = self._records[name]
        if len(pieces) != len(self.moe_layers):
            raise RoutingError(
                f"the reference routed {len(pieces)} of {len(self.moe_layers)} MoE layers"
            )
        return torch.stack(pieces)


def gap_drift(
    reference_gaps: torch.Tensor,
    reference_ids: torch.Tensor,
    run_gaps: torch.Tensor,
    run_ids: torch.Tensor,
) -> torch.Tensor:
    """float64 ``[...]``: how far a decision's relative tie gap moved between two router
    inputs of one token at one layer -- the reference replay's own row and the row the run
    recorded -- both seen by the same (the reference's) router: ``reference_gaps`` and
    ``run_gaps`` (float32 ``[...]``, :meth:`afd_models.Selection.tie_gaps`) with the top-k
    each chose (int ``[..., k]``, any order; all on one device).

    Where both chose the same experts it is ``|reference - run|``; where they chose
    differently the scores crossed, so the boundary moved by at least the two gaps together:
    ``reference + run``. 0 where neither has a boundary (both ``inf``); ``inf`` where one
    gap is not finite otherwise (NaN included): a drift that cannot be measured is no
    evidence of a small one."""
    k = reference_ids.shape[-1]
    same = ~differs(reference_ids.reshape(-1, k), run_ids.reshape(-1, k))
    same = same.reshape(reference_gaps.shape)
    a, b = reference_gaps.double(), run_gaps.double()
    drift = torch.where(same, (a - b).abs(), a + b)
    finite = torch.isfinite(a) & torch.isfinite(b)
    neither = torch.isinf(a) & torch.isinf(b) & (a > 0) & (b > 0)
    drift = torch.where(finite, drift, torch.full_like(drift, math.inf))
    return torch.where(neither, torch.zeros_like(drift), drift)


__all__ = ["RoutingError", "RoutingLog", "TieFollower", "differs", "gap_drift"]
