"""Expert backends: every registered backend agrees with ``reference``; the registry."""

from __future__ import annotations

import afd_models_naive as naive
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import afd_models
from afd_models import (
    BackendUnavailable,
    ExpertBackend,
    ExpertWeights,
    GroupedRows,
    MonolithicModel,
    RandomWeights,
    ReferenceBackend,
    expert_backend_names,
    get_expert_backend,
    register_expert_backend,
    unregister_expert_backend,
)
from afd_models import preset as make_preset


def random_experts(
    num: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator
) -> ExpertWeights:
    gate_up = (torch.randn(num, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    down = (torch.randn(num, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    return ExpertWeights(0, tuple(range(100, 100 + num)), gate_up, down)


def per_row_reference(work: GroupedRows, experts: ExpertWeights) -> torch.Tensor:
    """Row by row in float64, each row through the expert its group-list position names."""
    out = []
    inter = experts.intermediate_size
    local = 0
    seen = 0
    counts = work.group_list.tolist()
    for row in work.rows.double():
        while seen == counts[local]:
            local, seen = local + 1, 0
        gate_up = experts.gate_up[local].double() @ row
        hidden = naive.silu(gate_up[:inter]) * gate_up[inter:]
        out.append(experts.down[local].double() @ hidden)
        seen += 1
    return torch.stack(out) if out else torch.empty(0, work.rows.shape[1], dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    backend=st.sampled_from(["reference", "grouped_mm"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_backends_compute_each_row_by_its_group(
    counts: list[int], dtype: torch.dtype, backend: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 16, 8
    experts = random_experts(len(counts), hidden, inter, dtype, gen)
    rows = torch.randn(sum(counts), hidden, generator=gen).to(dtype)
    work = GroupedRows(rows, torch.tensor(counts, dtype=torch.int64))
    out = get_expert_backend(backend)(work, experts)
    assert out.shape == rows.shape
    assert out.dtype == dtype
    expected = per_row_reference(work, experts)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert naive.relative_error(out, expected) <= tolerance
    if backend != "reference":
        reference = get_expert_backend("reference")(work, experts)
        assert naive.relative_error(out, reference) <= tolerance


def test_grouped_rows_expand_the_group_list() -> None:
    work = GroupedRows(torch.zeros(5, 2), torch.tensor([2, 0, 3]))
    assert work.expert_ids().tolist() == [0, 0, 2, 2, 2]
    assert work.unit_weights().tolist() == [[1.0]] * 5


def test_backends_check_their_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    experts = random_experts(3, 8, 4, torch.float32, gen)
    with pytest.raises(ValueError, match="group list has 2 entries"):
        ReferenceBackend()(GroupedRows(torch.zeros(2, 8), torch.tensor([1, 1])), experts)
    with pytest.raises(TypeError, match="bfloat16"):
        ReferenceBackend()(
            GroupedRows(torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([1, 1, 0])), experts
        )


def test_registry_selects_backends_by_name() -> None:
    assert {"reference", "grouped_mm", "triton"} <= set(expert_backend_names())
    calls = []

    class Counting(ExpertBackend):
        name = "counting"

        def forward(self, work: GroupedRows, experts: ExpertWeights) -> torch.Tensor:
            calls.append(work.num_rows)
            return ReferenceBackend().forward(work, experts)

    register_expert_backend("counting", Counting)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_expert_backend("counting", Counting)
        config = make_preset("tiny")
        prompts = [[1, 2, 3, 4, 5]]
        out = MonolithicModel(config, RandomWeights(1), backend="counting").forward(prompts)
        ref = MonolithicModel(config, RandomWeights(1)).forward(prompts)
        assert torch.equal(out.hidden_states, ref.hidden_states)
        assert calls == [5 * config.num_experts_per_tok] * len(config.moe_layers)
    finally:
        unregister_expert_backend("counting")
    with pytest.raises(BackendUnavailable, match="unknown expert backend 'counting'"):
        get_expert_backend("counting")


def test_factory_errors_reach_the_caller() -> None:
    def needs_vllm() -> ExpertBackend:
        raise BackendUnavailable("backend 'fused_experts' needs vLLM; pip install vllm")

    register_expert_backend("fused_experts_test", needs_vllm)
    try:
        with pytest.raises(BackendUnavailable, match="needs vLLM"):
            MonolithicModel(make_preset("tiny"), backend="fused_experts_test")
    finally:
        unregister_expert_backend("fused_experts_test")


def test_grouped_mm_without_the_operator_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(BackendUnavailable, match=r"torch\._grouped_mm.*reference"):
        get_expert_backend("grouped_mm")


def test_grouped_mm_that_cannot_run_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_expert_backend("grouped_mm")

    def unsupported(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("grouped gemm is not supported for this dtype")

    monkeypatch.setattr(torch, "_grouped_mm", unsupported)
    experts = random_experts(2, 8, 4, torch.float32, torch.Generator().manual_seed(0))
    work = GroupedRows(torch.zeros(3, 8), torch.tensor([1, 2]))
    with pytest.raises(BackendUnavailable, match=r"cpu with torch\.float32.*'reference'"):
        backend(work, experts)


def test_afd_models_exports_the_registry() -> None:
    assert afd_models.register_expert_backend is register_expert_backend


def test_an_ffn_ranks_experts_are_views_of_one_stack_equal_to_per_layer_loads() -> None:
    from afd_models import ExpertStack, FFNRoleExecutor

    config = make_preset("tiny")
    local = (1, 3, 4)
    executor = FFNRoleExecutor(config, local, RandomWeights(2))
    stack = executor.stack
    assert isinstance(stack, ExpertStack)
    assert stack.moe_layers == tuple(config.moe_layers)
    assert stack.gate_up.shape[:2] == (len(config.moe_layers), len(local))
    base = stack.gate_up.untyped_storage().data_ptr()
    for layer in config.moe_layers:
        view = executor.experts[layer]
        alone = ExpertWeights.load(
            config, layer, local, RandomWeights(2), torch.float32, torch.device("cpu")
        )
        assert torch.equal(view.gate_up, alone.gate_up)
        assert torch.equal(view.down, alone.down)
        assert view.gate_up.untyped_storage().data_ptr() == base  # a view, not a copy
        assert view.layer == layer
    dense = next(i for i in range(config.num_hidden_layers) if i not in config.moe_layers)
    with pytest.raises(KeyError, match=f"layer {dense} is not an MoE layer"):
        stack.layer(dense)
