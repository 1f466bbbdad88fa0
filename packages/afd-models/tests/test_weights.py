"""Weights: deterministic per name, safetensors round trip, role-filtered loading."""

from __future__ import annotations

import json

import afd_models_naive as naive
import pytest
import torch
from safetensors.torch import save_file

from afd_models import (
    AttentionRoleModel,
    FFNRoleExecutor,
    ModelParams,
    MonolithicModel,
    RandomWeights,
    SafetensorsWeights,
    WeightSelection,
    WeightsError,
    is_routed_expert,
    materialize,
    save_checkpoint,
)
from afd_models import preset as make_preset
from afd_models.weights import name_seed

PROMPTS = [[1, 2, 3, 4, 5, 6], [100, 200, 300]]


def test_name_seed_is_a_stable_hash() -> None:
    """Fixed values: Python's hash() is salted per process, so it would not reproduce these
    (and two roles in two processes would draw different weights)."""
    assert name_seed(7, "model.norm.weight") == 7492250732169795868
    assert name_seed(0, "lm_head.weight") == 1468893650478585951
    assert name_seed(7, "model.norm.weight") != name_seed(8, "model.norm.weight")
    assert name_seed(7, "model.norm.weight") != name_seed(7, "lm_head.weight")


def test_roles_build_identical_tensors_without_exchanging_them() -> None:
    config = make_preset("v3-mini")
    mono = MonolithicModel(config, RandomWeights(5)).tensors()
    attention = AttentionRoleModel(config, RandomWeights(5), shared_placement="attention")
    ffn_rank = FFNRoleExecutor(config, [3, 9, 15], RandomWeights(5), shared_placement="ffn")
    for part in (attention.tensors(), ffn_rank.tensors()):
        for name, tensor in part.items():
            assert torch.equal(tensor, mono[name]), name
    # Built in another order, as a subset, the values are still the same.
    alone = FFNRoleExecutor(config, [15], RandomWeights(5)).tensors()
    for name, tensor in alone.items():
        assert torch.equal(tensor, mono[name]), name
    other = MonolithicModel(config, RandomWeights(6)).tensors()
    assert not torch.equal(other["model.norm.weight"], mono["model.norm.weight"])


def test_roles_hold_only_their_share() -> None:
    config = make_preset("tiny")
    attention = AttentionRoleModel(config, shared_placement="attention").tensors()
    assert attention
    assert not any(is_routed_expert(n) for n in attention)
    assert any(".mlp.shared_experts." in n for n in attention)
    attention_ffn_shared = AttentionRoleModel(config, shared_placement="ffn").tensors()
    assert not any(".mlp.shared_experts." in n or is_routed_expert(n) for n in attention_ffn_shared)
    rank = FFNRoleExecutor(config, [2, 5], shared_placement="ffn").tensors()
    experts = {int(n.split(".")[5]) for n in rank if is_routed_expert(n)}
    assert experts == {2, 5}
    assert all(is_routed_expert(n) or ".mlp.shared_experts." in n for n in rank)
    assert not any(".mlp.shared_experts." in n for n in FFNRoleExecutor(config, [2]).tensors())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_round_trip(tmp_path, dtype: torch.dtype) -> None:
    config = make_preset("v3-mini")
    tensors = materialize(config, RandomWeights(3), dtype=dtype)
    assert set(tensors) == {s.name for s in ModelParams(config).specs(WeightSelection.monolithic())}
    save_checkpoint(tmp_path, config, tensors)
    source = SafetensorsWeights(tmp_path)
    assert set(source.names()) == set(tensors)
    loaded = MonolithicModel(config, source, dtype=dtype)
    for name, tensor in loaded.tensors().items():
        assert torch.equal(tensor, tensors[name]), name
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert loaded.tensors()[bias].dtype == torch.float32  # kept in fp32 whatever the dtype
    fresh = MonolithicModel(config, RandomWeights(3), dtype=dtype)
    assert torch.equal(loaded.forward(PROMPTS).hidden_states, fresh.forward(PROMPTS).hidden_states)


def test_role_filtered_loading(tmp_path) -> None:
    config = make_preset("tiny")
    save_checkpoint(tmp_path, config, materialize(config, RandomWeights(3)))

    source = SafetensorsWeights(tmp_path)
    attention = AttentionRoleModel(config, source, shared_placement="attention")
    assert source.requested
    assert not any(is_routed_expert(n) for n in source.requested)
    assert not any(is_routed_expert(n) for n in attention.tensors())

    source = SafetensorsWeights(tmp_path)
    FFNRoleExecutor(config, [1, 6], source, shared_placement="attention")
    expected = {
        spec.name
        for layer in config.moe_layers
        for expert in (1, 6)
        for spec in ModelParams(config).expert(layer, expert).values()
    }
    assert set(source.requested) == expected

    source = SafetensorsWeights(tmp_path)
    FFNRoleExecutor(config, [0], source, shared_placement="ffn")
    shared = {n for n in source.requested if ".mlp.shared_experts." in n}
    assert len(shared) == 3 * len(config.moe_layers)


def test_sharded_checkpoint_with_index(tmp_path) -> None:
    config = make_preset("tiny")
    tensors = materialize(config, RandomWeights(4))
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(tmp_path / file))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = MonolithicModel(config, SafetensorsWeights(tmp_path))
    reference = MonolithicModel(config, RandomWeights(4))
    assert torch.equal(
        model.forward(PROMPTS).hidden_states, reference.forward(PROMPTS).hidden_states
    )


def test_checkpoint_mismatches_are_named(tmp_path) -> None:
    config = make_preset("tiny")
    tensors = materialize(config, RandomWeights(4))
    del tensors["model.layers.2.mlp.experts.7.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(3)
    save_checkpoint(tmp_path, config, tensors)
    with pytest.raises(WeightsError, match=r"model\.norm\.weight has shape \(3,\)"):
        MonolithicModel(config, SafetensorsWeights(tmp_path))
    with pytest.raises(WeightsError, match=r"experts\.7\.up_proj\.weight is not in checkpoint"):
        FFNRoleExecutor(config, [7], SafetensorsWeights(tmp_path))
    with pytest.raises(WeightsError, match="no checkpoint"):
        SafetensorsWeights(tmp_path / "missing")


def test_random_weights_have_sane_scales() -> None:
    config = make_preset("tiny")
    weights = materialize(config, RandomWeights(0))
    assert weights["model.layers.1.mlp.gate.weight"].std().item() == pytest.approx(
        config.hidden_size**-0.5, rel=0.2
    )
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert 0.8 < norm.mean().item() < 1.2
    assert norm.std().item() > 0.01
    out = MonolithicModel(config, RandomWeights(0)).forward(PROMPTS)
    assert torch.isfinite(out.hidden_states).all()
    assert naive.relative_error(out.hidden_states, torch.zeros_like(out.hidden_states)) > 0
