"""The role split over the shared-memory transport: real processes, 2 attention
replicas x 2 FFN ranks, different prompts per replica, equal to MonolithicModel."""

from __future__ import annotations

import afd_models_naive as naive
import afd_models_workers as workers
import pytest
import torch

from afd_models import MonolithicModel, RandomWeights, is_routed_expert
from afd_models import preset as make_preset
from afd_protocol import Role, SlotLayout, Topology
from afd_protocol.launch import RankSpec, launch

SEED = 21
STAGES = [1, 3]
# Replica 0: three prompts; replica 1: four others, one of them longer than a stage.
PROMPTS = {
    0: [[(7 * i + 3) % 512 for i in range(n)] for n in (9, 21, 4)],
    1: [[(11 * i + 5) % 512 for i in range(n)] for n in (13, 6, 27, 2)],
}


@pytest.mark.parametrize(
    ("preset_name", "dtype", "shared", "tolerance", "backend"),
    [
        ("tiny", "float32", "attention", 1e-5, "reference"),
        ("v3-mini", "float32", "ffn", 1e-5, "grouped_mm"),
        ("v3-mini", "bfloat16", "attention", 2e-2, "reference"),
        ("tiny", "bfloat16", "ffn", 2e-2, "grouped_mm"),
    ],
)
def test_two_replicas_two_ffn_ranks_equal_monolithic(
    preset_name: str, dtype: str, shared: str, tolerance: float, backend: str
) -> None:
    config = make_preset(preset_name)
    topology = Topology(2, 2, config.n_routed_experts)
    tokens = max(sum(map(len, p)) for p in PROMPTS.values())
    layout = SlotLayout(
        topology,
        config.hidden_size,
        tokens,
        config.num_experts_per_tok,
        dtype=dtype,
        routed_cap_multiplier=2.0,  # = F: fits any routing
        shared_placement=shared,
    )
    window = layout.window(ring_depth=max(STAGES))
    common = {"preset_name": preset_name, "dtype": dtype, "shared_placement": shared, "seed": SEED}
    specs = [
        RankSpec(
            Role.ATTENTION,
            replica,
            workers.attention_rank,
            {**common, "prompts": PROMPTS[replica], "stage_counts": STAGES},
        )
        for replica in (0, 1)
    ] + [
        RankSpec(Role.FFN, rank, workers.ffn_rank, {**common, "backend": backend})
        for rank in (0, 1)
    ]
    results = launch(window, specs, timeout=120)

    reference = MonolithicModel(config, RandomWeights(SEED), dtype=getattr(torch, dtype))
    for replica in (0, 1):
        value = results[f"attention rank {replica}"].value
        expected = reference.forward(PROMPTS[replica]).hidden_states
        for stages in STAGES:
            error = naive.relative_error(value["hidden"][stages], expected)
            assert error <= tolerance, (replica, stages, error)
        # With 3 stages, later stages' attention ran while earlier ones were at the FFN.
        assert value["max_in_flight"] == {1: 1, 3: 3}
        assert value["routed_expert_tensors"] == []
        assert value["requested_routed"] == []

    served = []
    for rank in (0, 1):
        value = results[f"ffn rank {rank}"].value
        own = set(value["local_experts"])
        assert all(is_routed_expert(n) for n in value["requested"] if ".shared_experts." not in n)
        assert {int(n.split(".")[5]) for n in value["requested"] if is_routed_expert(n)} == own
        assert (value["shared_rows"] > 0) == (shared == "ffn")
        served += value["served"]
    assert {replica for replica, _, _ in served} == {0, 1}
    assert {layer for _, layer, _ in served} == set(config.moe_layers)
    assert {stage for _, _, stage in served} == {0, 1, 2}
