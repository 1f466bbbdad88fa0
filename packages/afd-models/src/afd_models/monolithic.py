"""The colocated reference model: prompt tokens to final hidden states and logits.

Every routed expert lives in this process; each MoE layer routes, sorts its rows by
expert, runs the expert backend and combines with the weights (see
:mod:`afd_models.moe`). The role split must reproduce its outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from afd_models._common import resolve
from afd_models.backends import ExpertBackend, get_expert_backend
from afd_models.batch import KVCache, Prompt, PromptBatch
from afd_models.config import DeepseekConfig
from afd_models.experts import ExpertWeights
from afd_models.moe import MoELayer
from afd_models.output import PrefillOutput
from afd_models.router import LayerSelect
from afd_models.schedule import run_prefill
from afd_models.trunk import Trunk
from afd_models.weights import WeightSource


class MonolithicModel:
    """The whole model in one process.

    ``weights`` defaults to ``RandomWeights(seed=0)``; ``backend`` names the expert
    backend (``"reference"``, ``"grouped_mm"``, or any registered one).
    """

    def __init__(
        self,
        config: DeepseekConfig,
        weights: WeightSource | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str | ExpertBackend = "reference",
    ) -> None:
        source, self.dtype, self.device = resolve(weights, dtype, device)
        self.config = config
        self.backend = get_expert_backend(backend)
        self.trunk = Trunk(config, source, dtype=dtype, device=self.device, with_shared=True)
        everyone = range(config.n_routed_experts)
        self.moe_layers: dict[int, MoELayer] = {}
        for layer in config.moe_layers:
            experts = ExpertWeights.load(config, layer, everyone, source, dtype, self.device)
            self.moe_layers[layer] = MoELayer(
                config,
                self.trunk.router(layer),
                self.trunk.layers[layer].shared,
                experts,
                self.backend,
            )

    def forward(
        self,
        prompts: Sequence[Prompt],
        *,
        num_stages: int = 1,
        compute_logits: bool = True,
        cache: KVCache | None = None,
        select: LayerSelect | None = None,
    ) -> PrefillOutput:
        """Prefill ``prompts``; ``num_stages > 1`` runs the token-level stage split
        (same results up to rounding; it exercises the chunked attention path). Entries may
        be chunks of longer prompts (:class:`~afd_models.batch.PromptChunk`), with a ``cache``
        the caller keeps between calls (chunked prefill). ``select`` sees every MoE layer's
        routing and may replace its top-k (:data:`~afd_models.router.LayerSelect`)."""
        batch = PromptBatch.from_prompts(prompts, self.device)
        with torch.inference_mode():
            return run_prefill(
                self.trunk,
                batch,
                _LocalMoE(self.moe_layers, select),
                num_stages=num_stages,
                compute_logits=compute_logits,
                cache=cache,
            )

    __call__ = forward

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter by Hugging Face checkpoint name (expert tensors are views)."""
        out = self.trunk.tensors()
        for moe in self.moe_layers.values():
            out.update(moe.experts.tensors(self.config))
        return out


class _LocalMoE:
    """MoE execution in this process: ``begin`` computes, ``end`` hands it over."""

    def __init__(self, layers: dict[int, MoELayer], select: LayerSelect | None = None) -> None:
        self.layers = layers
        self.select = select

    def begin(self, layer: int, stage: int, x: torch.Tensor) -> Any:
        if self.select is None:
            return self.layers[layer](x)
        return self.layers[layer](x, functools.partial(self.select, layer))

    def end(self, handle: Any) -> torch.Tensor:
        out: torch.Tensor = handle
        return out
