"""Rank programs of the connector tests (a module of their own, so that spawned rank
processes can import them by name)."""

from __future__ import annotations

from typing import Any

import torch

from afd_protocol import Role, WindowLayout, serve
from afd_protocol.testing import LinearExperts, random_routing
from afd_vllm import ops
from afd_vllm.config import parse_afd_config
from afd_vllm.connectors.base import ModelGeometry
from afd_vllm.connectors.factory import create_connector

GEOMETRY = ModelGeometry(
    hidden_size=32,
    num_experts=8,
    topk=2,
    num_layers=3,
    max_num_batched_tokens=64,
    dtype="float32",
)


def connector(role: Role, folder: str) -> Any:
    config = parse_afd_config(
        {
            "afd": {
                "role": role.value,
                "connector": "HostAsyncAFDConnector",
                "connector_extra_config": {"rendezvous_dir": folder},
            }
        }
    )
    assert config is not None
    return create_connector(config, GEOMETRY)


def open_connection(
    window: WindowLayout, role: Role, rank: int, rendezvous: str, timeout: float
) -> Any:
    return connector(role, rendezvous).connect(rank, timeout)


def attention(connection: Any) -> float:
    """Three layers through the compiled operators; the worst error against the reference."""
    endpoint = connection.attention_endpoint(connector(Role.ATTENTION, "").endpoint_options())
    ops.bind_endpoint(endpoint)
    experts = LinearExperts(GEOMETRY.num_layers, GEOMETRY.num_experts, GEOMETRY.hidden_size)
    compiled = torch.compile(ops.dispatch_and_combine, backend="aot_eager", fullgraph=True)
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    try:
        for layer in range(GEOMETRY.num_layers):
            x, ids, weights = random_routing(
                20, GEOMETRY.hidden_size, GEOMETRY.topk, range(GEOMETRY.num_experts), gen
            )
            out = compiled(x, ids, weights, layer)
            expected = experts.reference(layer, x, ids, weights, include_shared=False)
            worst = max(worst, float((out.double() - expected).abs().max()))
    finally:
        endpoint.announce_shutdown()
        ops.unbind_endpoint()
    return worst


def ffn(connection: Any) -> int:
    endpoint = connection.ffn_endpoint(connector(Role.FFN, "").endpoint_options())
    experts = LinearExperts(GEOMETRY.num_layers, GEOMETRY.num_experts, GEOMETRY.hidden_size)
    return len(serve(endpoint, experts.compute_for(endpoint)).items)
