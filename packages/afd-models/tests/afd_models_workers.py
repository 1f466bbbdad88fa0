"""Rank programs for the multi-process role-split tests (spawned by afd_protocol.launch).

Both roles build their weights from the same seed by parameter name, so nothing but
activations crosses the transport. The attention ranks return their final hidden states
(float32, on the CPU) for the parent process to compare with ``MonolithicModel``.
"""

from __future__ import annotations

from typing import Any

import torch

from afd_models import (
    AttentionRoleModel,
    FFNRoleExecutor,
    RandomWeights,
    is_routed_expert,
    preset,
)
from afd_protocol import Connection, EndpointOptions


def attention_rank(
    connection: Connection,
    *,
    preset_name: str,
    dtype: str,
    shared_placement: str,
    seed: int,
    prompts: list[list[int]],
    stage_counts: list[int],
) -> dict[str, Any]:
    config = preset(preset_name)
    source = RandomWeights(seed)
    model = AttentionRoleModel(
        config, source, dtype=getattr(torch, dtype), shared_placement=shared_placement
    )
    options = EndpointOptions(timeout=60.0, num_layers=config.num_hidden_layers)
    endpoint = connection.attention_endpoint(options)
    hidden, in_flight = {}, {}
    for stages in stage_counts:
        out = model.forward(prompts, endpoint, num_stages=stages)
        hidden[stages] = out.hidden_states.float().clone()
        in_flight[stages] = model.stats.max_in_flight
    endpoint.announce_shutdown()
    return {
        "hidden": hidden,
        "max_in_flight": in_flight,
        "routed_expert_tensors": [n for n in model.tensors() if is_routed_expert(n)],
        "requested_routed": [n for n in source.requested if is_routed_expert(n)],
    }


def ffn_rank(
    connection: Connection,
    *,
    preset_name: str,
    dtype: str,
    shared_placement: str,
    seed: int,
    backend: str,
) -> dict[str, Any]:
    config = preset(preset_name)
    options = EndpointOptions(timeout=60.0, num_layers=config.num_hidden_layers)
    endpoint = connection.ffn_endpoint(options)
    source = RandomWeights(seed)
    executor = FFNRoleExecutor(
        config,
        endpoint.local_experts,
        source,
        dtype=getattr(torch, dtype),
        backend=backend,
        shared_placement=shared_placement,
    )
    stats = executor.serve(endpoint)
    return {
        "served": stats.served,
        "local_experts": list(endpoint.local_experts),
        "requested": list(source.requested),
        "shared_rows": stats.shared_rows,
    }
