"""The MoE layer (router + shared + routed experts) against the naive per-token,
per-selected-expert reference, including the float16 routed-scaling rule."""

from __future__ import annotations

import dataclasses

import afd_models_naive as naive
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_models import BranchScales, DeepseekConfig, MonolithicModel, RandomWeights
from afd_models import preset as make_preset


def v2_greedy() -> DeepseekConfig:
    return make_preset("tiny", routed_scaling_factor=1.7)


def v2_grouped() -> DeepseekConfig:
    return make_preset(
        "tiny",
        topk_method="group_limited_greedy",
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=2,
        routed_scaling_factor=16.0,
    )


def v3_noaux() -> DeepseekConfig:
    return make_preset("v3-mini")


def v3_no_shared() -> DeepseekConfig:
    return make_preset("v3-mini", n_shared_experts=0, norm_topk_prob=False)


CONFIGS = {
    "v2-greedy": v2_greedy,
    "v2-grouped": v2_grouped,
    "v3": v3_noaux,
    "v3-noshared": v3_no_shared,
}
_MODELS: dict[tuple[str, str, str], MonolithicModel] = {}


def model(
    name: str, dtype: torch.dtype = torch.float32, backend: str = "reference"
) -> MonolithicModel:
    key = (name, str(dtype), backend)
    if key not in _MODELS:
        _MODELS[key] = MonolithicModel(
            CONFIGS[name](), RandomWeights(11), dtype=dtype, backend=backend
        )
    return _MODELS[key]


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    backend=st.sampled_from(["reference", "grouped_mm"]),
    tokens=st.integers(1, 24),
    seed=st.integers(0, 2**31 - 1),
)
def test_moe_layer_matches_naive_reference(name: str, backend: str, tokens: int, seed: int) -> None:
    m = model(name, backend=backend)
    layer = m.config.moe_layers[-1]
    x = torch.randn(tokens, m.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        out = m.moe_layers[layer](x)
    expected = naive.moe(m.config, m.tensors(), layer, x)
    assert out.dtype == torch.float32
    assert naive.relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("name", ["v2-grouped", "v3"])
def test_float16_scales_the_shared_branch_down_instead(name: str) -> None:
    """In float16 the MoE output is the true output divided by routed_scaling_factor."""
    fp16 = model(name, torch.float16)
    config = fp16.config
    assert config.routed_scaling_factor != 1.0
    layer = config.moe_layers[0]
    x = torch.randn(16, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = fp16.moe_layers[layer](x.half())
    expected = naive.moe(config, fp16.tensors(), layer, x.half().double())
    assert naive.relative_error(out.double() * config.routed_scaling_factor, expected) <= 5e-3
    # bf16 applies the plain rule: the output is the true one.
    bf16 = model(name, torch.bfloat16)
    with torch.inference_mode():
        out = bf16.moe_layers[layer](x.bfloat16())
    expected = naive.moe(config, bf16.tensors(), layer, x.bfloat16().double())
    assert naive.relative_error(out, expected) <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_routed_weights_are_the_routers_for_any_experts(name: str, dtype: torch.dtype) -> None:
    """``MoELayer.routed_weights``, what the verification holds a replica's sent weights to:
    for the router's own top-k and for other experts, the naive router's weights of those
    experts on the model's own gate (renormalised with ``norm_topk_prob``), times the routed
    scale the dtype applies (none in float16); its selection is the naive top-k."""
    m = model(name, dtype)
    config, layer = m.config, m.config.moe_layers[-1]
    moe, gate = m.moe_layers[layer], m.tensors()[f"model.layers.{layer}.mlp.gate.weight"]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, config.hidden_size, generator=gen).to(dtype)
    k, experts = config.num_experts_per_tok, config.n_routed_experts
    others = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(9)])
    scale = 1.0 if dtype == torch.float16 else config.routed_scaling_factor
    with torch.inference_mode():
        own = moe.router(x).topk_ids
        for ids in (own, others):
            selection, weights = moe.routed_weights(x, ids)
            assert weights.dtype == torch.float32
            assert weights.shape == (9, k)
            expected = torch.tensor(
                [naive.token_weights(config, gate, x[t], ids[t].tolist()) for t in range(9)],
                dtype=torch.float64,
            )
            assert torch.isfinite(weights).all()
            assert torch.allclose(weights.double(), expected * scale, rtol=1e-5, atol=0)
            assert torch.equal(selection.ids, own)
    bias_name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    bias = m.tensors()[bias_name].double() if bias_name in m.tensors() else None
    for t in range(9):
        assert set(own[t].tolist()) == set(naive.route_token(config, gate, bias, x[t]))


def test_branch_scales() -> None:
    assert BranchScales.for_dtype(2.5, torch.bfloat16) == BranchScales(2.5, 1.0, 1.0)
    assert BranchScales.for_dtype(2.5, torch.float32) == BranchScales(2.5, 1.0, 1.0)
    assert BranchScales.for_dtype(2.5, torch.float16) == BranchScales(1.0, 0.4, 0.4)


def test_whole_model_in_float16_matches_float32() -> None:
    """The float16 rule keeps the residual stream consistent: the final norm cancels it."""
    config = dataclasses.replace(make_preset("tiny"), routed_scaling_factor=4.0)
    prompts = [list(range(3, 40, 3)), [7, 1, 9, 300]]
    ref = MonolithicModel(config, RandomWeights(2)).forward(prompts).hidden_states
    out = MonolithicModel(config, RandomWeights(2), dtype=torch.float16).forward(prompts)
    assert naive.relative_error(out.hidden_states, ref) <= 1e-2
