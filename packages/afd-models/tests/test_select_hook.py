"""The router's select hook and its Selection: the tie gaps on hand-made scores, forced
experts computed with the router's own weights (against the naive reference), the hook
seen at every MoE layer and stage, and the role split honouring it as the monolithic
model does."""

from __future__ import annotations

import dataclasses
import math
import threading

import afd_models_naive as naive
import pytest
import torch

from afd_models import (
    AttentionRoleModel,
    DeepseekConfig,
    FFNRoleExecutor,
    MonolithicModel,
    RandomWeights,
    Router,
    Selection,
)
from afd_models import preset as make_preset
from afd_protocol import EndpointOptions, Role, SlotLayout, Topology
from afd_protocol.window import LoopbackWorld

SEED = 11


def one_token_router(
    config: DeepseekConfig, logits: list[float], bias: torch.Tensor | None = None
) -> tuple[Router, torch.Tensor]:
    """A router and a one-token input whose gate logits are exactly ``logits``."""
    weight = torch.zeros(config.n_routed_experts, config.hidden_size)
    weight[:, 0] = torch.tensor(logits)
    x = torch.zeros(1, config.hidden_size)
    x[0, 0] = 1.0
    return Router(config, weight, bias), x


def selection_of(router: Router, x: torch.Tensor) -> Selection:
    seen: list[Selection] = []

    def keep(selection: Selection) -> torch.Tensor:
        seen.append(selection)
        return selection.ids

    router(x, keep)
    assert len(seen) == 1
    return seen[0]


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def test_expert_boundary_gap_is_relative_to_the_scores_there() -> None:
    """Softmax top-2 of 8: experts 1 and 2 are ``d`` apart in logits, so their scores are
    ``exp(d)`` apart and the relative gap is ``1 - exp(-d)``."""
    config = make_preset("tiny")
    assert (config.n_routed_experts, config.num_experts_per_tok) == (8, 2)
    d = 1e-3
    router, x = one_token_router(config, [3.0, 1.0, 1.0 - d, 0.0, -1.0, -2.0, -3.0, -4.0])
    selection = selection_of(router, x)
    assert sorted(selection.ids[0].tolist()) == [0, 1]
    gap = float(selection.tie_gaps()[0])
    assert gap == pytest.approx(1.0 - math.exp(-d), rel=1e-4)
    assert bool(selection.near_ties(2e-3)[0])
    assert not bool(selection.near_ties(5e-4)[0])


def test_a_clear_choice_has_a_large_gap() -> None:
    config = make_preset("tiny")
    router, x = one_token_router(config, [3.0, 2.0, 0.0, -1.0, -1.0, -2.0, -3.0, -4.0])
    gap = float(selection_of(router, x).tie_gaps()[0])
    assert gap == pytest.approx(1.0 - math.exp(-2.0), rel=1e-4)


def test_group_boundary_counts_with_the_unbiased_scores_as_scale() -> None:
    """V3 routing (sigmoid, noaux_tc, 4 groups of 4, keep 2, top 4) with a bias of 0.1 on
    every expert: groups 1 and 2 tie to ``d`` while every expert boundary is far; the gap
    is that of the group scores over the unbiased group score (the bias moves nothing)."""
    config = make_preset("v3-mini")
    assert (config.n_group, config.topk_group, config.num_experts_per_tok) == (4, 2, 4)
    d = 1e-3
    low = -6.0
    logits = [2.0, 1.9, low, low, 1.5, 1.4, low, low, 1.5, 1.4 - d, low, low, 0.0, 0.0, low, low]
    router, x = one_token_router(config, logits, torch.full((16,), 0.1))
    selection = selection_of(router, x)
    assert sorted(selection.ids[0].tolist()) == [0, 1, 4, 5]
    assert selection.group_choice is not None
    group_gap = sigmoid(1.4) - sigmoid(1.4 - d)
    expected = group_gap / (sigmoid(1.5) + sigmoid(1.4))
    assert float(selection.tie_gaps()[0]) == pytest.approx(expected, rel=1e-3)


def test_no_candidate_beyond_the_top_k_is_no_tie() -> None:
    config = dataclasses.replace(make_preset("tiny"), n_routed_experts=2, num_experts_per_tok=2)
    router, x = one_token_router(config, [1.0, 1.0])
    assert float(selection_of(router, x).tie_gaps()[0]) == math.inf


@pytest.mark.parametrize("name", ["tiny", "v3-mini"])
def test_forced_experts_get_the_routers_own_weights(name: str) -> None:
    """A hook sends token 2 to its two lowest-scoring experts: the MoE output is the naive
    one with those experts, weighted by the router's scores there (renormalised when
    ``norm_topk_prob``); every other token is routed as usual."""
    model = MonolithicModel(make_preset(name), RandomWeights(SEED))
    config, layer = model.config, model.config.moe_layers[-1]
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(3))

    def force(selection: Selection) -> torch.Tensor:
        ids = selection.ids.clone()
        lowest = selection.scores[2].argsort()[: ids.shape[1]]
        ids[2] = lowest
        return ids

    with torch.inference_mode():
        out = model.moe_layers[layer](x, force)
    weights = model.tensors()
    prefix = f"model.layers.{layer}.mlp."
    gate = naive.w64(weights, f"{prefix}gate.weight")
    expected = naive.moe(config, weights, layer, x)
    token = x[2].double()
    scores = naive.token_scores(config, gate, token)
    chosen = sorted(range(config.n_routed_experts), key=lambda e: scores[e])[
        : config.num_experts_per_tok
    ]
    total = sum(scores[e] for e in chosen) if config.norm_topk_prob else 1.0
    forced = naive.mlp(weights, f"{prefix}shared_experts.", token)
    for e in chosen:
        scale = config.routed_scaling_factor * scores[e] / total
        forced = forced + scale * naive.mlp(weights, f"{prefix}experts.{e}.", token)
    expected[2] = forced
    assert naive.relative_error(out, expected) <= 1e-5


def test_an_identity_hook_changes_nothing_and_sees_every_layer_and_stage() -> None:
    model = MonolithicModel(make_preset("v3-mini"), RandomWeights(SEED))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    calls: list[tuple[int, int]] = []

    def record(layer: int, selection: Selection) -> torch.Tensor:
        calls.append((layer, selection.ids.shape[0]))
        return selection.ids

    plain = model.forward(prompts, num_stages=2)
    hooked = model.forward(prompts, num_stages=2, select=record)
    assert torch.equal(plain.hidden_states, hooked.hidden_states)
    assert plain.logits is not None
    assert hooked.logits is not None
    assert torch.equal(plain.logits, hooked.logits)
    stages = [5, 5]  # 10 tokens in two stages
    assert calls == [(layer, n) for layer in model.config.moe_layers for n in stages]


def test_a_hook_must_return_the_routers_shape_and_dtype() -> None:
    config = make_preset("tiny")
    router, x = one_token_router(config, [3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    with pytest.raises(ValueError, match=r"returned torch.int32 \(1, 2\) top-k ids"):
        router(x, lambda s: s.ids.to(torch.int32))
    with pytest.raises(ValueError, match=r"returned torch.int64 \(1, 1\) top-k ids"):
        router(x, lambda s: s.ids[:, :1])


def swap_last_choice(layer: int, selection: Selection) -> torch.Tensor:
    """At the last MoE layer, every even token's k-th expert becomes its (k+1)-th."""
    if layer != 2:
        return selection.ids
    ids = selection.ids.clone()
    k = ids.shape[1]
    nxt = selection.choice.topk(k + 1, dim=-1).indices[:, k]
    ids[::2, k - 1] = nxt[::2]
    return ids


def test_the_role_split_dispatches_what_the_hook_returns() -> None:
    """The same hook in the attention role (over loopback, two FFN ranks) and in the
    monolithic model gives the same outputs, which differ from the unhooked ones."""
    config = make_preset("v3-mini")
    assert config.moe_layers[-1] == 2
    topology = Topology(1, 2, config.n_routed_experts)
    layout = SlotLayout(
        topology, config.hidden_size, 64, config.num_experts_per_tok, dtype="float32"
    )
    world = LoopbackWorld(layout.window(ring_depth=2))
    served: list[object] = []

    def serve(rank: int) -> None:
        endpoint = world.connection(Role.FFN, rank).ffn_endpoint(EndpointOptions(timeout=20.0))
        executor = FFNRoleExecutor(config, endpoint.local_experts, RandomWeights(SEED))
        served.append(executor.serve(endpoint))

    threads = [threading.Thread(target=serve, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    endpoint = world.connection(Role.ATTENTION, 0).attention_endpoint(EndpointOptions(timeout=20.0))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [400, 3, 2]]
    model = AttentionRoleModel(config, RandomWeights(SEED))
    try:
        out = model.forward(prompts, endpoint, num_stages=2, select=swap_last_choice)
    finally:
        endpoint.announce_shutdown()
    for t in threads:
        t.join(timeout=30)
    assert len(served) == 2
    mono = MonolithicModel(config, RandomWeights(SEED))
    expected = mono.forward(prompts, num_stages=2, select=swap_last_choice).hidden_states
    assert naive.relative_error(out.hidden_states, expected) <= 1e-5
    unhooked = mono.forward(prompts, num_stages=2).hidden_states
    assert naive.relative_error(unhooked, expected) > 1e-3
