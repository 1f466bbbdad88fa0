"""Everything of the model except the routed experts, shared by both execution paths.

The trunk holds the embeddings, every layer's norms and MLA attention, the dense MLPs,
the routers, the shared experts (when this process runs them), the final norm and the
lm head. :class:`~afd_models.monolithic.MonolithicModel` pairs it with local routed
experts; :class:`~afd_models.attention_role.AttentionRoleModel` with an
``AttentionEndpoint``. Both run the same trunk code, so a difference between them can
only come from the routed experts' execution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as nnf

from afd_models.attention import MLAttention
from afd_models.batch import KVCache, Segment
from afd_models.config import DeepseekConfig
from afd_models.mlp import GatedMLP
from afd_models.norm import RMSNorm
from afd_models.params import ModelParams
from afd_models.rotary import RotaryEmbedding
from afd_models.router import Router
from afd_models.scaling import BranchScales
from afd_models.weights import WeightSource


@dataclass
class TrunkLayer:
    """One decoder layer without its routed experts."""

    input_norm: RMSNorm
    attention: MLAttention
    post_norm: RMSNorm
    norm_names: tuple[str, str]
    dense: GatedMLP | None = None
    router: Router | None = None
    shared: GatedMLP | None = None


class Trunk:
    """See the module docstring; ``with_shared`` loads the shared experts here."""

    def __init__(
        self,
        config: DeepseekConfig,
        source: WeightSource,
        *,
        dtype: torch.dtype,
        device: torch.device,
        with_shared: bool,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.scales = BranchScales.for_dtype(config.routed_scaling_factor, dtype)
        params = ModelParams(config)
        eps = config.rms_norm_eps
        self.embed_spec = params.embed()
        self.embed = source.get(self.embed_spec, dtype, device)
        rotary = RotaryEmbedding(
            config.qk_rope_head_dim,
            config.rope_theta,
            config.rope_scaling,
            interleaved=config.rope_interleave,
            device=device,
        )
        self.layers: list[TrunkLayer] = []
        for index in range(config.num_hidden_layers):
            specs = params.attention(index)
            norms = (specs["input_layernorm"], specs["post_attention_layernorm"])
            layer = TrunkLayer(
                input_norm=RMSNorm(source.get(norms[0], dtype, device), eps),
                attention=MLAttention(config, index, specs, source, rotary, dtype, device),
                post_norm=RMSNorm(source.get(norms[1], dtype, device), eps),
                norm_names=(norms[0].name, norms[1].name),
            )
            if config.is_moe_layer(index):
                layer.router = Router.load(config, params.gate(index), source, dtype, device)
                shared = params.shared_experts(index)
                if with_shared and shared:
                    layer.shared = GatedMLP.load(shared, source, dtype, device)
            else:
                layer.dense = GatedMLP.load(params.dense_mlp(index), source, dtype, device)
            self.layers.append(layer)
        self.norm_spec = params.final_norm()
        self.norm = RMSNorm(source.get(self.norm_spec, dtype, device), eps)
        head = params.lm_head()
        self.head_name = None if head is None else head.name
        self.lm_head = self.embed if head is None else source.get(head, dtype, device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the trunk holds, by checkpoint name."""
        out = {self.embed_spec.name: self.embed}
        for layer in self.layers:
            out[layer.norm_names[0]] = layer.input_norm.weight
            out.update(layer.attention.tensors())
            out[layer.norm_names[1]] = layer.post_norm.weight
            for part in (layer.dense, layer.router, layer.shared):
                if part is not None:
                    out.update(part.tensors())
        out[self.norm_spec.name] = self.norm.weight
        if self.head_name is not None:
            out[self.head_name] = self.lm_head
        return out

    def _stream(self, x: torch.Tensor) -> torch.Tensor:
        """Scale a residual-stream contribution (only float16 scales; see scaling)."""
        return x if self.scales.stream == 1.0 else x * self.scales.stream

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._stream(nnf.embedding(token_ids, self.embed))

    def attention_block(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[Segment],
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual stream after attention, post-attention-normed MLP input)``."""
        block = self.layers[layer]
        attended = block.attention(block.input_norm(hidden), positions, segments, cache)
        hidden = hidden + self._stream(attended)
        return hidden, block.post_norm(hidden)

    def dense_mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        dense = self.layers[layer].dense
        if dense is None:
            raise ValueError(f"layer {layer} is an MoE layer, not a dense one")
        return self._stream(dense(x))

    def router(self, layer: int) -> Router:
        router = self.layers[layer].router
        if router is None:
            raise ValueError(f"layer {layer} is a dense layer: it has no router")
        return router

    def shared_experts(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' (scaled) output, or ``None`` if they do not run here."""
        shared = self.layers[layer].shared
        if shared is None:
            return None
        out = shared(x)
        return out if self.scales.shared == 1.0 else out * self.scales.shared

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed ``hidden [n, H]``."""
        return nnf.linear(hidden, self.lm_head).float()
