"""The role split in one process over the loopback transport (FFN ranks in threads):
multi-participant replicas, and the errors that catch mismatched roles."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import afd_models_naive as naive
import pytest
import torch

from afd_models import (
    AttentionRoleModel,
    ComputeWrapper,
    ConfigError,
    DeepseekConfig,
    FFNRoleExecutor,
    MonolithicModel,
    RandomWeights,
)
from afd_models import preset as make_preset
from afd_protocol import (
    Compute,
    EndpointOptions,
    FFNEndpoint,
    RingExhausted,
    Role,
    ServeStats,
    SlotLayout,
    Topology,
    WindowLayout,
    WorkItem,
)
from afd_protocol.window import LoopbackWorld

SEED = 8


def window_for(
    preset_name: str,
    attention: int,
    ffn: int,
    *,
    per_dp: int = 1,
    dtype: str = "float32",
    shared: str = "attention",
    ring_depth: int = 3,
    tokens: int = 64,
    wire: str = "per_choice",
    reduce: str = "attention",
) -> WindowLayout:
    config = make_preset(preset_name)
    topology = Topology(attention, ffn, config.n_routed_experts, attn_ranks_per_dp=per_dp)
    layout = SlotLayout(
        topology,
        config.hidden_size,
        tokens,
        config.num_experts_per_tok,
        dtype=dtype,
        routed_cap_multiplier=float(ffn),
        shared_placement=shared,
        wire_format=wire,
        combine_reduce=reduce,
    )
    return layout.window(ring_depth=ring_depth)


def serve_in_threads(
    world: LoopbackWorld, preset_name: str, dtype: torch.dtype, shared: str, backend: str
) -> tuple[list[threading.Thread], dict[int, Any]]:
    config = make_preset(preset_name)
    results: dict[int, Any] = {}

    def serve(rank: int) -> None:
        endpoint = world.connection(Role.FFN, rank).ffn_endpoint(EndpointOptions(timeout=20.0))
        executor = FFNRoleExecutor(
            config,
            endpoint.local_experts,
            RandomWeights(SEED),
            dtype=dtype,
            backend=backend,
            shared_placement=shared,
        )
        try:
            results[rank] = executor.serve(endpoint)
        except Exception as exc:  # reported to the test thread
            results[rank] = exc

    topology = world.window.slot.topology
    threads = [
        threading.Thread(target=serve, args=(r,), daemon=True)
        for r in range(topology.num_ffn_ranks)
    ]
    for t in threads:
        t.start()
    return threads, results


def prefill_in_threads(
    world: LoopbackWorld,
    config: DeepseekConfig,
    prompts: dict[int, list[list[int]]],
    stages: dict[int, int],
    ffn_threads: list[threading.Thread],
    *,
    shared: str = "attention",
) -> dict[int, Any]:
    """Each attention rank of ``prompts`` prefills its prompts in a thread with
    ``stages[rank]`` stages, then announces shutdown; waits for them and ``ffn_threads``.
    Returns each rank's last hidden states (float ``[tokens, hidden]``) or its exception."""
    outputs: dict[int, Any] = {}

    def attend(rank: int) -> None:
        endpoint = world.connection(Role.ATTENTION, rank).attention_endpoint(
            EndpointOptions(timeout=20.0)
        )
        model = AttentionRoleModel(config, RandomWeights(SEED), shared_placement=shared)
        try:
            out = model.forward(prompts[rank], endpoint, num_stages=stages[rank])
            outputs[rank] = out.hidden_states
            endpoint.announce_shutdown()
        except Exception as exc:  # reported to the test thread
            outputs[rank] = exc
            endpoint.abort()

    ranks = [threading.Thread(target=attend, args=(r,), daemon=True) for r in prompts]
    for t in ranks:
        t.start()
    for t in ranks + ffn_threads:
        t.join(timeout=60)
    return outputs


@pytest.mark.parametrize(
    ("wire", "reduce"),
    [("per_choice", "attention"), ("per_rank", "ffn"), ("per_rank", "attention")],
)
def test_replica_of_two_participants_and_grouped_mm_ffn(wire: str, reduce: str) -> None:
    """Two attention ranks form one DP replica: each work item has two parts; in every wire
    format the FFN executor gets its rows grouped by expert and replies what it wants."""
    window = window_for("v3-mini", 2, 3, per_dp=2, shared="ffn", wire=wire, reduce=reduce)
    world = LoopbackWorld(window)
    threads, served = serve_in_threads(world, "v3-mini", torch.float32, "ffn", "grouped_mm")
    config = make_preset("v3-mini")
    prompts = {0: [[1, 2, 3, 4, 5, 6, 7], [9, 8]], 1: [[40, 41, 42], [300] * 11]}
    outputs = prefill_in_threads(world, config, prompts, {0: 2, 1: 2}, threads, shared="ffn")
    reference = MonolithicModel(config, RandomWeights(SEED))
    for rank in (0, 1):
        assert isinstance(outputs[rank], torch.Tensor), outputs[rank]
        expected = reference.forward(prompts[rank]).hidden_states
        assert naive.relative_error(outputs[rank], expected) <= 1e-5
    for stats in served.values():
        assert not isinstance(stats, Exception), stats
        assert stats.items
        assert all(replica == 0 for replica, _, _ in stats.served)


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_the_observed_exchange_is_what_the_experts_give(shared: str) -> None:
    """An observer sees every MoE layer of every stage once, its rows in order; what the
    combine returned for them is the reference layer's ``exchanged`` on the same rows,
    experts and weights (with the shared experts exactly when they ran on the FFN side)."""
    config = make_preset("v3-mini")
    world = LoopbackWorld(window_for("v3-mini", 1, 2, shared=shared, wire="per_rank",
                                     reduce="ffn"))  # fmt: skip
    threads, _ = serve_in_threads(world, "v3-mini", torch.float32, shared, "reference")
    endpoint = world.connection(Role.ATTENTION, 0).attention_endpoint(EndpointOptions(timeout=20.0))
    model = AttentionRoleModel(config, RandomWeights(SEED), shared_placement=shared)
    seen: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def observe(
        layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        def returned(out: torch.Tensor) -> None:
            seen.append((layer, x.shape[0], x.clone(), ids.clone(), w.clone(), out.clone()))

        return returned

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [400, 3, 2]]
    try:
        model.forward(prompts, endpoint, num_stages=2, observe=observe)
    finally:
        endpoint.announce_shutdown()
    for t in threads:
        t.join(timeout=30)
    moe = list(config.moe_layers)
    assert [layer for layer, *_ in seen] == [layer for layer in moe for _ in range(2)]
    assert all(rows for _, rows, *_ in seen)
    assert sum(rows for layer, rows, *_ in seen if layer == moe[0]) == 11  # every token once
    reference = MonolithicModel(config, RandomWeights(SEED))
    for layer, _, x, ids, w, out in seen:
        assert ids.dtype == torch.int64
        assert w.dtype == torch.float32
        expected = reference.moe_layers[layer].exchanged(x, ids, w, with_shared=shared == "ffn")
        assert naive.relative_error(out, expected) <= 1e-5, layer
        other = reference.moe_layers[layer].exchanged(x, ids, w, with_shared=shared != "ffn")
        assert naive.relative_error(out, other) > 1e-3  # the shared experts are a real part


def test_float16_with_shared_experts_on_the_ffn_side() -> None:
    """The float16 rule (shared branch scaled down, on the FFN rank) matches monolithic."""
    config = make_preset("v3-mini")
    assert config.routed_scaling_factor != 1.0
    world = LoopbackWorld(window_for("v3-mini", 1, 2, dtype="float16", shared="ffn"))
    threads, served = serve_in_threads(world, "v3-mini", torch.float16, "ffn", "reference")
    endpoint = world.connection(Role.ATTENTION, 0).attention_endpoint(EndpointOptions(timeout=20.0))
    model = AttentionRoleModel(
        config, RandomWeights(SEED), dtype=torch.float16, shared_placement="ffn"
    )
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [400, 3, 2]]
    try:
        out = model.forward(prompts, endpoint, num_stages=2).hidden_states
    finally:
        endpoint.announce_shutdown()
    for t in threads:
        t.join(timeout=30)
    assert all(stats.shared_rows > 0 for stats in served.values()), served
    mono = MonolithicModel(config, RandomWeights(SEED), dtype=torch.float16)
    expected = mono.forward(prompts).hidden_states
    assert naive.relative_error(out, expected) <= 2e-2


def test_window_dtype_must_match_the_model() -> None:
    world = LoopbackWorld(window_for("tiny", 1, 1, dtype="bfloat16"))
    endpoint = world.connection(Role.ATTENTION, 0).attention_endpoint(EndpointOptions(timeout=1.0))
    model = AttentionRoleModel(make_preset("tiny"))
    with pytest.raises(ConfigError, match=r"window carries torch\.bfloat16"):
        model.forward([[1, 2, 3]], endpoint)


def test_shared_placement_must_match_the_window() -> None:
    world = LoopbackWorld(window_for("tiny", 1, 1, shared="ffn"))
    endpoint = world.connection(Role.ATTENTION, 0).attention_endpoint(EndpointOptions(timeout=1.0))
    model = AttentionRoleModel(make_preset("tiny"), shared_placement="attention")
    with pytest.raises(ConfigError, match="shared_placement is 'ffn'"):
        model.forward([[1, 2, 3]], endpoint)


def test_stages_need_a_ring_slot_each() -> None:
    world = LoopbackWorld(window_for("tiny", 1, 1, ring_depth=1))
    endpoint = world.connection(Role.ATTENTION, 0).attention_endpoint(EndpointOptions(timeout=1.0))
    model = AttentionRoleModel(make_preset("tiny"))
    with pytest.raises(RingExhausted, match="ring exhausted"):
        model.forward([[1, 2, 3, 4]], endpoint, num_stages=2)


def dispatch_one(world: LoopbackWorld, layer: int, tokens: int = 5) -> FFNEndpoint:
    """Dispatch ``tokens`` random rows of ``layer`` from attention rank 0 to FFN rank 0."""
    slot = world.window.slot
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, slot.hidden_size, generator=gen)
    ids = torch.zeros(tokens, slot.topk, dtype=torch.long)
    ids += torch.arange(slot.topk)
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(EndpointOptions(timeout=1.0))
    attention.dispatch(layer, x, ids, torch.ones(tokens, slot.topk))
    return world.connection(Role.FFN, 0).ffn_endpoint(EndpointOptions(timeout=1.0))


def test_ffn_executor_rejects_what_its_config_cannot_serve() -> None:
    config = make_preset("tiny")
    world = LoopbackWorld(window_for("tiny", 1, 1, shared="ffn"))
    ffn = dispatch_one(world, layer=1)
    item = ffn.next_work_item()
    executor = FFNRoleExecutor(config, ffn.local_experts, shared_placement="attention")
    with pytest.raises(ConfigError, match="shared-expert rows"):
        executor.compute(item)
    right = FFNRoleExecutor(config, ffn.local_experts, shared_placement="ffn")
    routed, shared = right.compute(item)
    assert routed.shape == (5 * config.num_experts_per_tok, config.hidden_size)
    assert shared is not None
    assert shared.shape == (5, config.hidden_size)
    with pytest.raises(ConfigError, match="owns"):
        FFNRoleExecutor(config, [0, 1]).serve(ffn)
    with pytest.raises(ConfigError, match="shared_placement is 'ffn'"):
        FFNRoleExecutor(config, ffn.local_experts, shared_placement="attention").serve(ffn)

    dense = dispatch_one(LoopbackWorld(window_for("tiny", 1, 1)), layer=0)
    with pytest.raises(ConfigError, match="not an MoE layer"):
        FFNRoleExecutor(config, dense.local_experts).compute(dense.next_work_item())
    with pytest.raises(ConfigError, match="local_experts"):
        FFNRoleExecutor(config, [8])


def test_the_ffn_rank_program_serves_a_connection_with_wrappers_and_live_stats() -> None:
    """``serve_rank`` (what afd run's FFN ranks and afd-vllm ffn both run): the endpoint
    opens with the given options before ``on_ready``, the compute wrappers nest in order,
    idle stretches longer than the endpoint's timeout are waited out, and the stats the
    caller holds count every replica's items; the prefill still equals monolithic's."""
    config = make_preset("tiny")
    world = LoopbackWorld(window_for("tiny", 2, 2))
    layers = len(config.moe_layers)
    ready: dict[int, int] = {}
    calls: dict[int, list[str]] = {0: [], 1: []}
    stats = {0: ServeStats(), 1: ServeStats()}
    results: dict[int, Any] = {}

    def tag(rank: int, name: str) -> ComputeWrapper:
        def wrap(compute: Compute) -> Compute:
            def run(item: WorkItem) -> tuple[torch.Tensor, torch.Tensor | None]:
                calls[rank].append(name)
                return compute(item)

            return run

        return wrap

    def serve_rank(rank: int) -> None:
        connection = world.connection(Role.FFN, rank)
        executor = FFNRoleExecutor(
            config, world.window.slot.topology.local_experts(rank), RandomWeights(SEED)
        )
        try:
            results[rank] = executor.serve_rank(
                connection,
                EndpointOptions(timeout=0.1),  # shorter than the idle start below
                compute_wrappers=[tag(rank, "inner"), tag(rank, "outer")],
                stats=stats[rank],
                on_ready=lambda: ready.setdefault(rank, len(stats[rank].items)),
            )
        except Exception as exc:  # reported to the test thread
            results[rank] = exc

    threads = [threading.Thread(target=serve_rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # nothing to serve yet: the program keeps waiting
    prompts = {0: [[1, 2, 3, 4, 5]], 1: [[7, 8, 9], [10, 11]]}
    outputs = prefill_in_threads(world, config, prompts, {0: 1, 1: 2}, threads)
    reference = MonolithicModel(config, RandomWeights(SEED))
    for rank, out in outputs.items():
        assert isinstance(out, torch.Tensor), out
        expected = reference.forward(prompts[rank]).hidden_states
        assert naive.relative_error(out, expected) <= 1e-5
    assert ready == {0: 0, 1: 0}
    for rank in (0, 1):
        assert results[rank] is stats[rank], results[rank]
        # Replica 0 ran one stage per MoE layer, replica 1 two.
        assert stats[rank].per_replica(2) == [layers, 2 * layers]
        assert calls[rank] == ["outer", "inner"] * len(stats[rank].items)
