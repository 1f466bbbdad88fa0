"""Colocated DP+EP's exchange: each rank's local partials, summed over the ranks, are the
whole MoE layer's routed output (checked against afd_models' colocated MoE), and the
endpoint pads, refuses and shuts down as documented."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_models import RandomWeights, preset
from afd_models.backends import get_expert_backend
from afd_models.experts import ExpertWeights
from afd_models.moe import routed_experts
from afd_protocol import (
    CapacityError,
    ConnectorShutdown,
    EndpointOptions,
    SharedPlacement,
    SlotLayout,
    Topology,
)
from afd_tools.run.expert_parallel import (
    ExpertParallelEndpoint,
    local_expert_table,
    local_partials,
)

CONFIG = preset("tiny")
LAYER = CONFIG.moe_layers[0]
CPU = torch.device("cpu")


def _experts(ids: tuple[int, ...]) -> ExpertWeights:
    return ExpertWeights.load(CONFIG, LAYER, ids, RandomWeights(3), torch.float32, CPU)


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, CONFIG.hidden_size, generator=gen)
    scores = torch.rand(tokens, CONFIG.n_routed_experts, generator=gen)
    ids = scores.topk(CONFIG.num_experts_per_tok, dim=1).indices
    weights = torch.rand(tokens, CONFIG.num_experts_per_tok, generator=gen)
    return x, ids, weights


@settings(max_examples=25, deadline=None)
@given(
    ranks=st.integers(1, 5),
    tokens=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_local_partials_summed_over_the_ranks_are_the_routed_output(
    ranks: int, tokens: int, seed: int
) -> None:
    x, ids, weights = _routing(tokens, seed)
    backend = get_expert_backend("reference")
    everyone = tuple(range(CONFIG.n_routed_experts))
    expected = routed_experts(x, ids, weights, _experts(everyone), backend)
    topology = Topology(ranks, ranks, CONFIG.n_routed_experts)
    total = torch.zeros(tokens, CONFIG.hidden_size)
    for rank in range(ranks):
        local = topology.local_experts(rank)
        table = local_expert_table(CONFIG.n_routed_experts, local, CPU)
        total += local_partials(x, ids, weights, table, _experts(local), backend)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_padding_rows_point_past_the_experts_and_add_nothing() -> None:
    x, ids, weights = _routing(6, 0)
    local = tuple(range(CONFIG.n_routed_experts))
    table = local_expert_table(CONFIG.n_routed_experts, local, CPU)
    ids[3:] = CONFIG.n_routed_experts  # the sentinel the endpoint pads with
    out = local_partials(x, ids, weights, table, _experts(local), get_expert_backend("reference"))
    assert torch.count_nonzero(out[3:]) == 0
    assert torch.count_nonzero(out[:3]) > 0


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _endpoint(max_tokens: int = 16) -> ExpertParallelEndpoint:
    topology = Topology(1, 1, CONFIG.n_routed_experts)
    layout = SlotLayout(
        topology,
        CONFIG.hidden_size,
        max_tokens,
        CONFIG.num_experts_per_tok,
        dtype="float32",
        shared_placement=SharedPlacement.ATTENTION,
    )
    experts = {LAYER: _experts(topology.local_experts(0))}
    return ExpertParallelEndpoint(
        layout, 0, experts, get_expert_backend("reference"), CPU, EndpointOptions()
    )


@pytest.mark.usefixtures("one_rank_group")
def test_the_endpoint_pads_to_the_step_and_returns_only_its_tokens() -> None:
    endpoint = _endpoint()
    x, ids, weights = _routing(5, 1)
    endpoint.begin_step(9)  # another rank has 9 tokens this step
    handle = endpoint.dispatch(LAYER, x, ids, weights)
    assert endpoint.in_flight == 1
    out = endpoint.combine(handle)
    assert endpoint.in_flight == 0
    everyone = tuple(range(CONFIG.n_routed_experts))
    expected = routed_experts(x, ids, weights, _experts(everyone), get_expert_backend("reference"))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("one_rank_group")
def test_the_endpoint_refuses_what_the_step_did_not_agree_and_stops_after_shutdown() -> None:
    endpoint = _endpoint(max_tokens=16)
    with pytest.raises(CapacityError, match=r"a step of 17 tokens per rank; the exchange holds"):
        endpoint.begin_step(17)
    endpoint.begin_step(4)
    x, ids, weights = _routing(5, 2)
    with pytest.raises(CapacityError, match="this step was agreed at 4 per rank"):
        endpoint.dispatch(LAYER, x, ids, weights)
    endpoint.announce_shutdown()
    with pytest.raises(ConnectorShutdown):
        endpoint.dispatch(LAYER, x[:4], ids[:4], weights[:4])
