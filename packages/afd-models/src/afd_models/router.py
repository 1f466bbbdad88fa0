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
"""

from __future__ import annotations

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

    def __call__(self, x: torch.Tensor) -> Routing:
        c = self.config
        scores = self.scores(x)
        choice = scores if self.bias is None else scores + self.bias
        if c.grouped_topk:
            tokens = choice.shape[0]
            grouped = choice.view(tokens, c.n_group, -1)
            if c.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            keep = group_scores.topk(c.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            expert_mask = group_mask.repeat_interleave(grouped.shape[-1], dim=1)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(ids, weights)
