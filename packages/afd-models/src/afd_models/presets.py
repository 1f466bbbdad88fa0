"""Named model shapes for tests and benchmarks.

* ``tiny`` -- V2 routing (softmax, greedy) at toy sizes; a CPU forward takes milliseconds.
  The MLA head is 576 wide (``kv_lora_rank`` 512 + rope 64), the one size vLLM's CPU MLA
  backend accepts, so the same config can later run in a real engine.
* ``v2-lite`` -- DeepSeek-V2-Lite's exact shapes (27 layers, the first dense).
* ``v3-mini`` -- V3 routing (sigmoid, ``noaux_tc`` with correction bias, 4 groups of 4
  experts, 2 groups kept, ``norm_topk_prob``, ``routed_scaling_factor`` 2.5) and a
  ``q_lora_rank``, at toy sizes.
* ``v3-slice`` -- DeepSeek-V3 layer shapes with ``num_layers`` layers (default 4), all of
  them MoE, for GPU benchmarks of the real per-layer costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from afd_models.config import DeepseekConfig, RopeScaling
from afd_models.errors import ConfigError

V2_LITE_YARN = RopeScaling(
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=0.707,
)
V3_YARN = RopeScaling(
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def _v2_lite() -> DeepseekConfig:
    return DeepseekConfig(
        architecture="DeepseekV2ForCausalLM",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        q_lora_rank=None,
        rope_scaling=V2_LITE_YARN,
    )


def _tiny() -> DeepseekConfig:
    """DeepSeek-V2-Lite shrunk to test size: the same routing, MLA layout and YaRN, with a
    small vocabulary, width, depth and expert count."""
    return dataclasses.replace(
        _v2_lite(),
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        qk_nope_head_dim=32,
        v_head_dim=32,
    )


def _v3_mini() -> DeepseekConfig:
    """``tiny`` shapes with DeepSeek-V3 routing: sigmoid scores, noaux_tc with a correction
    bias over groups, normalised top-k, a routed scaling factor, and a q LoRA."""
    return dataclasses.replace(
        _tiny(),
        architecture="DeepseekV3ForCausalLM",
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=48,
        rope_scaling=V3_YARN,
    )


def _v3_slice() -> DeepseekConfig:
    return DeepseekConfig(
        architecture="DeepseekV3ForCausalLM",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=0,
        moe_layer_freq=1,
        n_group=8,
        topk_group=4,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        q_lora_rank=1536,
        rope_scaling=V3_YARN,
    )


_PRESETS: dict[str, Callable[[], DeepseekConfig]] = {
    "tiny": _tiny,
    "v2-lite": _v2_lite,
    "v3-mini": _v3_mini,
    "v3-slice": _v3_slice,
}
PRESET_NAMES = tuple(_PRESETS)


def preset(name: str, *, num_layers: int | None = None, **overrides: Any) -> DeepseekConfig:
    """The named preset, with ``num_layers`` layers if given and any field overridden.

    ``preset("v3-slice", num_layers=8)``; ``preset("tiny", n_routed_experts=16)``. The
    result is validated like a ``config.json``.
    """
    try:
        build = _PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {list(PRESET_NAMES)}") from None
    config = build()
    if num_layers is not None:
        overrides["num_hidden_layers"] = num_layers
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(DeepseekConfig)})
    if unknown:
        raise ConfigError(f"preset override(s) {unknown} are not DeepseekConfig fields")
    return dataclasses.replace(config, **overrides)
