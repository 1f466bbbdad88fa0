"""Every parameter of a DeepSeek-V2/V3 model: Hugging Face name, shape, kind.

This is the one place that knows the checkpoint names
(``model.layers.N.mlp.experts.E.gate_proj.weight``, ...). The model code asks for
parameters through these specs, the random initialiser draws by name, the safetensors
loader reads by name, and :class:`WeightSelection` says which names a role
materialises -- so an attention rank never even asks for a routed expert.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from afd_models.config import DeepseekConfig
from afd_models.errors import ConfigError
from afd_protocol import SharedPlacement


class ParamKind(str, enum.Enum):
    """How a parameter is initialised at random (see :mod:`afd_models.weights`)."""

    EMBEDDING = "embedding"
    LINEAR = "linear"
    NORM = "norm"
    BIAS = "bias"


@dataclass(frozen=True)
class ParamSpec:
    """One checkpoint tensor."""

    name: str
    shape: tuple[int, ...]
    kind: ParamKind
    float32: bool = False
    """Kept in float32 whatever the model dtype (the ``noaux_tc`` correction bias)."""


def _linear(name: str, out_features: int, in_features: int) -> ParamSpec:
    return ParamSpec(name, (out_features, in_features), ParamKind.LINEAR)


def _norm(name: str, size: int) -> ParamSpec:
    return ParamSpec(name, (size,), ParamKind.NORM)


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def is_routed_expert(name: str) -> bool:
    """Whether ``name`` is a routed-expert tensor (what the attention role never holds)."""
    return ".mlp.experts." in name


def mlp_specs(prefix: str, hidden: int, intermediate: int) -> dict[str, ParamSpec]:
    """A SiLU-gated MLP: ``gate_proj``, ``up_proj`` ``[I, H]`` and ``down_proj`` ``[H, I]``."""
    return {
        "gate_proj": _linear(f"{prefix}gate_proj.weight", intermediate, hidden),
        "up_proj": _linear(f"{prefix}up_proj.weight", intermediate, hidden),
        "down_proj": _linear(f"{prefix}down_proj.weight", hidden, intermediate),
    }


class ModelParams:
    """Parameter specs of one configuration, grouped the way the modules consume them."""

    def __init__(self, config: DeepseekConfig) -> None:
        self.config = config

    def embed(self) -> ParamSpec:
        c = self.config
        return ParamSpec(
            "model.embed_tokens.weight", (c.vocab_size, c.hidden_size), ParamKind.EMBEDDING
        )

    def final_norm(self) -> ParamSpec:
        return _norm("model.norm.weight", self.config.hidden_size)

    def lm_head(self) -> ParamSpec | None:
        """``None`` when the embeddings are tied (the lm head then reuses them)."""
        c = self.config
        if c.tie_word_embeddings:
            return None
        return _linear("lm_head.weight", c.vocab_size, c.hidden_size)

    def attention(self, layer: int) -> dict[str, ParamSpec]:
        """Both norms of decoder layer ``layer`` and its MLA projections."""
        c = self.config
        p = layer_prefix(layer)
        a = f"{p}self_attn."
        heads = c.num_attention_heads
        specs = {
            "input_layernorm": _norm(f"{p}input_layernorm.weight", c.hidden_size),
            "post_attention_layernorm": _norm(f"{p}post_attention_layernorm.weight", c.hidden_size),
        }
        if c.q_lora_rank is None:
            specs["q_proj"] = _linear(f"{a}q_proj.weight", heads * c.qk_head_dim, c.hidden_size)
        else:
            specs["q_a_proj"] = _linear(f"{a}q_a_proj.weight", c.q_lora_rank, c.hidden_size)
            specs["q_a_layernorm"] = _norm(f"{a}q_a_layernorm.weight", c.q_lora_rank)
            specs["q_b_proj"] = _linear(f"{a}q_b_proj.weight", heads * c.qk_head_dim, c.q_lora_rank)
        specs["kv_a_proj_with_mqa"] = _linear(
            f"{a}kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size
        )
        specs["kv_a_layernorm"] = _norm(f"{a}kv_a_layernorm.weight", c.kv_lora_rank)
        specs["kv_b_proj"] = _linear(
            f"{a}kv_b_proj.weight", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank
        )
        specs["o_proj"] = _linear(f"{a}o_proj.weight", c.hidden_size, heads * c.v_head_dim)
        return specs

    def dense_mlp(self, layer: int) -> dict[str, ParamSpec]:
        self._check_kind(layer, moe=False)
        c = self.config
        return mlp_specs(f"{layer_prefix(layer)}mlp.", c.hidden_size, c.intermediate_size)

    def gate(self, layer: int) -> dict[str, ParamSpec]:
        """The router: ``weight [E, H]`` and, for ``noaux_tc``, the fp32 correction bias."""
        self._check_kind(layer, moe=True)
        c = self.config
        p = f"{layer_prefix(layer)}mlp.gate."
        specs = {"weight": _linear(f"{p}weight", c.n_routed_experts, c.hidden_size)}
        if c.uses_correction_bias:
            specs["e_score_correction_bias"] = ParamSpec(
                f"{p}e_score_correction_bias", (c.n_routed_experts,), ParamKind.BIAS, float32=True
            )
        return specs

    def shared_experts(self, layer: int) -> dict[str, ParamSpec]:
        """The shared experts, fused into one MLP (empty when ``n_shared_experts`` is 0)."""
        self._check_kind(layer, moe=True)
        c = self.config
        if not c.n_shared_experts:
            return {}
        prefix = f"{layer_prefix(layer)}mlp.shared_experts."
        return mlp_specs(prefix, c.hidden_size, c.shared_intermediate_size)

    def expert(self, layer: int, expert: int) -> dict[str, ParamSpec]:
        """Routed expert ``expert`` (global id) of MoE layer ``layer``."""
        self._check_kind(layer, moe=True)
        c = self.config
        if not 0 <= expert < c.n_routed_experts:
            raise ConfigError(f"expert {expert} is outside [0, {c.n_routed_experts})")
        prefix = f"{layer_prefix(layer)}mlp.experts.{expert}."
        return mlp_specs(prefix, c.hidden_size, c.moe_intermediate_size)

    def _check_kind(self, layer: int, *, moe: bool) -> None:
        if self.config.is_moe_layer(layer) != moe:
            kind = "an MoE" if moe else "a dense"
            raise ConfigError(f"layer {layer} is not {kind} layer of this configuration")

    def specs(self, selection: WeightSelection) -> Iterator[ParamSpec]:
        """Every spec ``selection`` materialises, in checkpoint order."""
        c = self.config
        if selection.trunk:
            yield self.embed()
        for layer in range(c.num_hidden_layers):
            moe = c.is_moe_layer(layer)
            if selection.trunk:
                yield from self.attention(layer).values()
                if not moe:
                    yield from self.dense_mlp(layer).values()
                else:
                    yield from self.gate(layer).values()
            if not moe:
                continue
            if selection.shared_experts:
                yield from self.shared_experts(layer).values()
            for expert in selection.experts(c.n_routed_experts):
                yield from self.expert(layer, expert).values()
        if selection.trunk:
            yield self.final_norm()
            head = self.lm_head()
            if head is not None:
                yield head


@dataclass(frozen=True)
class WeightSelection:
    """Which parameters one role materialises.

    ``trunk`` is everything but the experts: embeddings, attention, norms, dense MLPs,
    routers and the lm head. ``routed_experts`` lists global expert ids (``None``: all).
    """

    trunk: bool
    shared_experts: bool
    routed_experts: tuple[int, ...] | None

    @classmethod
    def monolithic(cls) -> WeightSelection:
        return cls(trunk=True, shared_experts=True, routed_experts=None)

    @classmethod
    def attention(cls, shared_placement: SharedPlacement | str) -> WeightSelection:
        """The attention role: the trunk, shared experts only when they run there."""
        return cls(True, _shared_here(shared_placement, "attention"), ())

    @classmethod
    def ffn(
        cls, local_experts: Iterable[int], shared_placement: SharedPlacement | str
    ) -> WeightSelection:
        """One FFN rank: its own routed experts, shared experts only when they run there."""
        return cls(False, _shared_here(shared_placement, "ffn"), tuple(local_experts))

    def experts(self, num_experts: int) -> tuple[int, ...]:
        if self.routed_experts is None:
            return tuple(range(num_experts))
        return self.routed_experts


def shared_placement_of(placement: SharedPlacement | str) -> SharedPlacement:
    """``placement`` as the protocol's enum, with a clear error for anything else."""
    try:
        return SharedPlacement(placement)
    except ValueError:
        raise ConfigError(
            f"shared_placement must be 'attention' or 'ffn', got {placement!r}"
        ) from None


def _shared_here(placement: SharedPlacement | str, role: str) -> bool:
    return shared_placement_of(placement).value == role
