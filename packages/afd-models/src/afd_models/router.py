"""The MoE router: scores, (grouped) top-k, correction bias, normalisation.

* Scores: ``softmax`` (V2) or ``sigmoid`` (V3) of the float32 gate logits.
* Selection: ``greedy`` takes the top-k scores. ``group_limited_greedy`` first keeps the
  ``topk_group`` expert groups with the highest *maximum* score. ``noaux_tc`` adds the
  ``e_score_correction_bias`` to the scores used for selection only, keeps the groups
  with the highest sum of their *two best* biased scores, then takes the top-k biased
  scores among the kept groups. Experts of dropped groups are masked with ``-inf`` (a
  zero would let a dropped expert beat kept ones whose biased score is negative).
* Weights: the *unbiased* scores of the chosen experts, renormalised to sum to one when
  ``norm_topk_prob``. ``routed_scaling_factor`` is not applied here; see
  :mod:`afd_models.scaling`.

A caller may pass a *select* hook (off by default; unused it costs one ``is None`` test):
it sees the router's :class:`Selection` -- the scores it chose from and its own top-k --
and returns the top-k ids to route by; the weights are then gathered from the router's
own scores at those ids. ``afd run``'s verification uses it twice: the rank processes
record every token's choice through it, and the reference replay takes the run's choice
where its own is within a rounding margin of a tie (:meth:`Selection.near_ties`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as nnf

from afd_models.config import DeepseekConfig
from afd_models.errors import ConfigError
from afd_models.params import ParamSpec
from afd_models.weights import WeightSource


@dataclass(frozen=True)
class Routing:
    """The router's decision for ``T`` tokens."""

    topk_ids: torch.Tensor
    """int64 ``[T, k]``: global expert ids."""
    topk_weights: torch.Tensor
    """float32 ``[T, k]``: the chosen experts' weights (before the routed scaling)."""


@dataclass(frozen=True)
class Selection:
    """What a router chose from for ``T`` tokens, and what it chose (for a select hook).

    Every tensor is on the router's device.
    """

    config: DeepseekConfig
    scores: torch.Tensor
    """float32 ``[T, E]``: the unbiased scores (softmax or sigmoid of the logits)."""
    choice: torch.Tensor
    """float32 ``[T, E]``: the selection scores: correction bias added, the experts of
    dropped groups ``-inf``."""
    group_choice: torch.Tensor | None
    """float32 ``[T, G]``: the scores the groups were ranked by (``None`` without grouped
    top-k)."""
    ids: torch.Tensor
    """int64 ``[T, k]``: the router's own top-k, best first."""

    def tie_gaps(self) -> torch.Tensor:
        """float32 ``[T]``: per token, the relative gap at its closest decision boundary.

        A boundary is the k-th against the (k+1)-th expert (selection scores), and with
        grouped top-k also the ``topk_group``-th against the next group (group scores).
        Its gap is divided by the unbiased scores at the boundary (the larger of the two;
        for groups the same group rule applied to the unbiased scores), because rounding
        in the router's input moves a score in proportion to the score itself and leaves
        the correction bias alone. ``inf`` where there is no boundary (no (k+1)-th
        candidate).
        """
        gaps = _boundary_gap(self.choice, self.scores, self.ids.shape[1])
        if self.group_choice is not None:
            tokens, groups = self.group_choice.shape
            unbiased = _group_scores(self.scores.view(tokens, groups, -1), self.config)
            group_gaps = _boundary_gap(self.group_choice, unbiased, self.config.topk_group)
            gaps = torch.minimum(gaps, group_gaps)
        return gaps

    def near_ties(self, margin: float) -> torch.Tensor:
        """bool ``[T]``: tokens whose top-k is within ``margin`` (relative) of a tie."""
        return self.tie_gaps() <= margin


Select = Callable[[Selection], torch.Tensor]
"""A router's select hook: the router's :class:`Selection` -> int64 ``[T, k]`` top-k ids to
route by, on the selection's device."""

LayerSelect = Callable[[int, Selection], torch.Tensor]
"""A forward's select hook: called at every MoE layer with the layer index and that
router's :class:`Selection` (layers in order; with several stages, a layer's stages in
order, each with its rows of the batch); returns the ids to route by, as :data:`Select`."""


def _boundary_gap(choice: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``[T]``: ``(choice_k - choice_k+1) / max(scale there)`` over the sorted
    ``choice [T, N]`` (``inf`` where ``N <= k`` or the (k+1)-th is ``-inf``)."""
    tokens, candidates = choice.shape
    if candidates <= k:
        return torch.full((tokens,), float("inf"), device=choice.device)
    top = choice.topk(k + 1, dim=-1)
    gap = top.values[:, k - 1] - top.values[:, k]
    at = scale.gather(1, top.indices[:, k - 1 :]).amax(dim=-1)
    return gap / at.clamp_min(torch.finfo(torch.float32).tiny)


def _group_scores(grouped: torch.Tensor, config: DeepseekConfig) -> torch.Tensor:
    """``[T, G]`` group ranking scores of ``grouped [T, G, E/G]``: the sum of each group's
    two best (``noaux_tc``) or its best."""
    if config.topk_method == "noaux_tc":
        return grouped.topk(2, dim=-1).values.sum(dim=-1)
    return grouped.amax(dim=-1)


class Router:
    """One MoE layer's gate."""

    def __init__(
        self, config: DeepseekConfig, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        if config.uses_correction_bias and bias is None:
            raise ConfigError("noaux_tc routing needs the e_score_correction_bias tensor")
        self.config = config
        self.weight = weight
        self.bias = bias
        self.names: dict[str, str] = {}

    @classmethod
    def load(
        cls,
        config: DeepseekConfig,
        specs: dict[str, ParamSpec],
        source: WeightSource,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Router:
        weight = source.get(specs["weight"], dtype, device)
        bias_spec = specs.get("e_score_correction_bias")
        bias = None if bias_spec is None else source.get(bias_spec, torch.float32, device)
        router = cls(config, weight, bias)
        router.names = {k: s.name for k, s in specs.items()}
        return router

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {self.names.get("weight", "weight"): self.weight}
        if self.bias is not None:
            out[self.names.get("e_score_correction_bias", "e_score_correction_bias")] = self.bias
        return out

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, E]`` routing scores (softmax or sigmoid of the logits)."""
        logits = nnf.linear(x.float(), self.weight.float())
        if self.config.scoring_func == "softmax":
            return logits.softmax(dim=-1)
        return logits.sigmoid()

    def __call__(self, x: torch.Tensor, select: Select | None = None) -> Routing:
        """Route ``x [T, H]``; ``select`` may replace the top-k (see the module docstring)."""
        c = self.config
        scores = self.scores(x)
        choice = scores if self.bias is None else scores + self.bias
        group_scores = None
        if c.grouped_topk:
            tokens = choice.shape[0]
            grouped = choice.view(tokens, c.n_group, -1)
            group_scores = _group_scores(grouped, c)
            keep = group_scores.topk(c.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            expert_mask = group_mask.repeat_interleave(grouped.shape[-1], dim=1)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        if select is not None:
            ids = _selected(select, Selection(c, scores, choice, group_scores, ids))
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(ids, weights)


def _selected(select: Select, selection: Selection) -> torch.Tensor:
    """The hook's ids, checked to have the router's own shape and dtype."""
    ids = select(selection)
    own = selection.ids
    if ids.shape != own.shape or ids.dtype != own.dtype:
        raise ValueError(
            f"a select hook returned {ids.dtype} {tuple(ids.shape)} top-k ids; the router "
            f"routes by {own.dtype} {tuple(own.shape)}"
        )
    return ids
