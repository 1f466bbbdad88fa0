"""Configuration: Hugging Face config.json in and out, presets, and clear errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from afd_models import PRESET_NAMES, ConfigError, DeepseekConfig, ModelParams, WeightSelection
from afd_models import preset as make_preset

# DeepSeek-V2-Lite's config.json (the fields that matter, as published).
V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


def v3_config() -> dict[str, Any]:
    """DeepSeek-V3's config.json shapes (with transformers' ``rope_type`` spelling)."""
    raw = dict(V2_LITE)
    raw.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        n_group=8,
        topk_group=4,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=1536,
        vocab_size=129280,
        num_nextn_predict_layers=1,
        rope_scaling={
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
        },
    )
    return raw


def test_reads_deepseek_v2_lite_config_json() -> None:
    config = DeepseekConfig.from_hf_dict(V2_LITE)
    assert config.architecture == "DeepseekV2ForCausalLM"
    assert config.moe_layers == tuple(range(1, 27))
    assert config.qk_head_dim == 192
    assert config.shared_intermediate_size == 2 * 1408
    assert config.rope_scaling is not None
    assert config.rope_scaling.factor == 40
    assert not config.grouped_topk
    assert not config.uses_correction_bias
    # v2-lite preset has exactly these shapes.
    assert make_preset("v2-lite") == config


def test_reads_deepseek_v3_config_json() -> None:
    config = DeepseekConfig.from_hf_dict(v3_config())
    assert config.architecture == "DeepseekV3ForCausalLM"
    assert config.moe_layers == tuple(range(3, 61))
    assert config.grouped_topk
    assert config.uses_correction_bias
    assert config.q_lora_rank == 1536
    # The v3-slice preset carries the same layer shapes and routing.
    slice_ = make_preset("v3-slice")
    for key in (
        "hidden_size",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "n_shared_experts",
        "moe_intermediate_size",
        "vocab_size",
        "topk_method",
        "scoring_func",
        "routed_scaling_factor",
        "rope_scaling",
    ):
        assert getattr(slice_, key) == getattr(config, key), key


def test_round_trips_through_json(tmp_path) -> None:
    for name in PRESET_NAMES:
        config = make_preset(name)
        file = config.save_json(tmp_path)
        assert DeepseekConfig.from_json(file) == config
        assert DeepseekConfig.from_json(tmp_path) == config
        assert json.loads(file.read_text())["architectures"] == [config.architecture]


def test_presets_have_the_documented_shapes() -> None:
    lite = make_preset("v2-lite")
    assert (lite.num_hidden_layers, lite.first_k_dense_replace, lite.hidden_size) == (27, 1, 2048)
    assert (lite.num_attention_heads, lite.n_routed_experts, lite.num_experts_per_tok) == (
        16,
        64,
        6,
    )
    assert (lite.n_shared_experts, lite.moe_intermediate_size, lite.kv_lora_rank) == (2, 1408, 512)
    assert (lite.qk_rope_head_dim, lite.qk_nope_head_dim, lite.v_head_dim) == (64, 128, 128)
    assert lite.vocab_size == 102400

    mini = make_preset("v3-mini")
    assert (mini.scoring_func, mini.topk_method, mini.norm_topk_prob) == (
        "sigmoid",
        "noaux_tc",
        True,
    )
    assert mini.n_group > 1
    assert mini.topk_group < mini.n_group
    assert mini.routed_scaling_factor != 1
    assert mini.hidden_size <= 128

    v3 = make_preset("v3-slice")
    assert (v3.hidden_size, v3.num_attention_heads, v3.q_lora_rank, v3.kv_lora_rank) == (
        7168,
        128,
        1536,
        512,
    )
    assert (v3.n_routed_experts, v3.num_experts_per_tok, v3.n_group, v3.n_shared_experts) == (
        256,
        8,
        8,
        1,
    )
    assert (v3.moe_intermediate_size, v3.vocab_size) == (2048, 129280)
    assert v3.num_hidden_layers == 4
    assert v3.moe_layers == (0, 1, 2, 3)
    eight = make_preset("v3-slice", num_layers=8)
    assert eight.moe_layers == tuple(range(8))

    tiny = make_preset("tiny")
    assert tiny.kv_lora_rank + tiny.qk_rope_head_dim == 576  # vLLM's CPU MLA head size


def test_parameter_names_and_shapes_follow_hugging_face() -> None:
    specs = {
        s.name: s.shape
        for s in ModelParams(make_preset("v2-lite")).specs(WeightSelection.monolithic())
    }
    assert specs["model.embed_tokens.weight"] == (102400, 2048)
    assert specs["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048)
    assert specs["model.layers.0.self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2048)
    assert specs["model.layers.0.self_attn.kv_b_proj.weight"] == (16 * 256, 512)
    assert specs["model.layers.0.self_attn.o_proj.weight"] == (2048, 16 * 128)
    assert specs["model.layers.1.mlp.gate.weight"] == (64, 2048)
    assert specs["model.layers.26.mlp.experts.63.down_proj.weight"] == (2048, 1408)
    assert specs["model.layers.5.mlp.shared_experts.up_proj.weight"] == (2816, 2048)
    assert specs["lm_head.weight"] == (102400, 2048)
    assert sum(".mlp.experts." in n for n in specs) == 26 * 64 * 3
    assert not any("e_score_correction_bias" in n for n in specs)
    v3 = {
        s.name: s for s in ModelParams(make_preset("v3-slice")).specs(WeightSelection.monolithic())
    }
    assert v3["model.layers.0.self_attn.q_a_proj.weight"].shape == (1536, 7168)
    assert v3["model.layers.0.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert v3["model.layers.3.mlp.gate.e_score_correction_bias"].float32


def test_unknown_architecture_is_named() -> None:
    raw = dict(V2_LITE, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM.*DeepseekV2ForCausalLM"):
        DeepseekConfig.from_hf_dict(raw)
    with pytest.raises(ConfigError, match="architectures"):
        DeepseekConfig.from_hf_dict({k: v for k, v in V2_LITE.items() if k != "architectures"})


def test_missing_fields_are_all_listed() -> None:
    raw = {k: v for k, v in V2_LITE.items() if k not in ("kv_lora_rank", "topk_method")}
    with pytest.raises(ConfigError) as info:
        DeepseekConfig.from_hf_dict(raw)
    assert "kv_lora_rank" in str(info.value)
    assert "topk_method" in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"topk_method": "top1"}, "topk_method"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"num_experts_per_tok": 65}, "num_experts_per_tok"),
        ({"topk_method": "group_limited_greedy", "n_group": 5}, "multiple of n_group"),
        ({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 9}, "topk_group"),
        ({"topk_method": "noaux_tc", "n_group": 64, "topk_group": 8}, "at least 2"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "yarn"),
        ({"qk_rope_head_dim": 63}, "even"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
    ],
)
def test_inconsistent_fields_fail_clearly(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeepseekConfig.from_hf_dict(dict(V2_LITE, **change))


def test_unknown_preset_and_override() -> None:
    with pytest.raises(ConfigError, match="unknown preset"):
        make_preset("v4")
    with pytest.raises(ConfigError, match="not DeepseekConfig fields"):
        make_preset("tiny", hidden=3)
    with pytest.raises(ConfigError, match="n_group"):
        make_preset("v3-mini", n_group=3)
