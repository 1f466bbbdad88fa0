"""The router against the naive per-token reference, across V2 and V3 routing settings."""

from __future__ import annotations

import dataclasses

import afd_models_naive as naive
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_models import DeepseekConfig, Router
from afd_models import preset as make_preset

# (topk_method, scoring_func, n_group, topk_group, experts, topk)
ROUTING = [
    ("greedy", "softmax", 1, 1, 8, 2),  # DeepSeek-V2-Lite style
    ("greedy", "sigmoid", 1, 1, 12, 3),
    ("group_limited_greedy", "softmax", 4, 2, 16, 3),  # DeepSeek-V2 style
    ("group_limited_greedy", "sigmoid", 3, 1, 9, 2),
    ("noaux_tc", "sigmoid", 4, 2, 16, 4),  # DeepSeek-V3 style
    ("noaux_tc", "softmax", 2, 1, 8, 3),
    ("noaux_tc", "sigmoid", 8, 4, 32, 8),
]


def routing_config(setting: tuple[str, str, int, int, int, int], norm: bool) -> DeepseekConfig:
    method, scoring, groups, keep, experts, topk = setting
    return dataclasses.replace(
        make_preset("tiny"),
        topk_method=method,
        scoring_func=scoring,
        n_group=groups,
        topk_group=keep,
        n_routed_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=norm,
    )


@settings(max_examples=40, deadline=None)
@given(
    setting=st.sampled_from(ROUTING),
    norm=st.booleans(),
    tokens=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
    bias_scale=st.sampled_from([0.0, 0.05, 0.5]),
    bias_shift=st.sampled_from([0.0, -2.0]),
)
def test_router_matches_naive_reference(
    setting: tuple[str, str, int, int, int, int],
    norm: bool,
    tokens: int,
    seed: int,
    bias_scale: float,
    bias_shift: float,
) -> None:
    config = routing_config(setting, norm)
    gen = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    weight = torch.randn(config.n_routed_experts, hidden, generator=gen) * hidden**-0.5
    bias = None
    if config.uses_correction_bias:
        # A negative shift makes every biased score negative: masking dropped groups
        # with 0 instead of -inf would then pick experts outside the kept groups.
        bias = torch.randn(config.n_routed_experts, generator=gen) * bias_scale + bias_shift
    x = torch.randn(tokens, hidden, generator=gen)
    routing = Router(config, weight, bias)(x)
    assert routing.topk_ids.shape == (tokens, config.num_experts_per_tok)
    assert routing.topk_ids.dtype == torch.int64
    assert routing.topk_weights.dtype == torch.float32
    for t in range(tokens):
        expected = naive.route_token(config, weight, bias, x[t])
        got = dict(zip(routing.topk_ids[t].tolist(), routing.topk_weights[t].tolist(), strict=True))
        assert set(got) == set(expected), (t, got, expected)
        for expert, w in expected.items():
            assert got[expert] == pytest.approx(w, rel=1e-5, abs=1e-7)
        if norm:
            assert sum(got.values()) == pytest.approx(1.0, rel=1e-5)


def test_correction_bias_changes_selection_but_not_weights() -> None:
    """noaux_tc selects by score + bias but weights by the unbiased score."""
    config = routing_config(("noaux_tc", "sigmoid", 4, 2, 16, 4), norm=False)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, config.hidden_size, generator=gen) * config.hidden_size**-0.5
    x = torch.randn(32, config.hidden_size, generator=gen)
    plain = Router(config, weight, torch.zeros(16))(x)
    favoured = torch.zeros(16)
    favoured[5] = 10.0  # expert 5 (group 1) always wins selection
    biased = Router(config, weight, favoured)(x)
    assert (biased.topk_ids == 5).any(dim=1).all()
    assert not torch.equal(plain.topk_ids, biased.topk_ids)
    scores = torch.sigmoid(x @ weight.T)
    torch.testing.assert_close(biased.topk_weights, scores.gather(1, biased.topk_ids))


def test_group_limit_keeps_experts_inside_the_chosen_groups() -> None:
    config = routing_config(("group_limited_greedy", "softmax", 4, 1, 16, 3), norm=False)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(16, config.hidden_size, generator=gen)
    x = torch.randn(64, config.hidden_size, generator=gen)
    ids = Router(config, weight)(x).topk_ids
    groups = ids // 4
    assert (groups == groups[:, :1]).all()  # one group kept: all choices share it
