"""What ``afd run``'s pieces share: the colocated baselines' connections have one peerless
base (an attention rank, its layout and device, no FFN endpoint), and a replica's record
of a mode is the :class:`~afd_tools.prefill.metrics.ReplicaTimes` that the simulator's
replicas record too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afd_models import preset
from afd_protocol import InvalidArgument, Role, SlotLayout, Topology, WindowLayout
from afd_tools.prefill.metrics import ReplicaTimes, summarize
from afd_tools.prefill.workload import Request
from afd_tools.run.expert_parallel import (
    STORE_FILE,
    ExpertParallelConnection,
    ExpertParallelEndpoint,
    expert_parallel_connection,
)
from afd_tools.run.monolithic import MonolithicConnection, monolithic_connection
from afd_tools.run.peerless import PeerlessConnection
from afd_tools.run.ranks import ModeResult
from afd_tools.sim.modes import ReplicaRecord

CONFIG = preset("tiny")


def _window() -> WindowLayout:
    topology = Topology(1, 1, CONFIG.n_routed_experts)
    slot = SlotLayout(topology, CONFIG.hidden_size, 16, CONFIG.num_experts_per_tok, dtype="float32")
    return slot.window(ring_depth=1)


def _is_peerless_rank_zero(connection: PeerlessConnection, window: WindowLayout) -> None:
    assert connection.role is Role.ATTENTION
    assert connection.rank == 0
    assert connection.layout == window.slot
    assert connection.device == torch.device("cpu")


def test_the_monolithic_connection_is_peerless_and_makes_no_endpoint() -> None:
    window = _window()
    connection = monolithic_connection(window, Role.ATTENTION, 0, "", 1.0, device="cpu")
    assert isinstance(connection, PeerlessConnection)
    _is_peerless_rank_zero(connection, window)
    nothing = "the monolithic model exchanges nothing: it has no endpoint"
    with pytest.raises(InvalidArgument, match=nothing):
        connection.attention_endpoint()
    with pytest.raises(InvalidArgument, match=nothing):
        connection.ffn_endpoint()
    connection.abort()
    connection.close()
    connection.close()  # idempotent
    with pytest.raises(InvalidArgument, match="one attention rank 0"):
        monolithic_connection(window, Role.FFN, 0, "", 1.0, device="cpu")
    assert nothing == MonolithicConnection.NO_FFN_ENDPOINT


def test_the_expert_parallel_connection_is_peerless_and_makes_the_exchange(
    tmp_path: Path,
) -> None:
    window = _window()
    options = {"config": CONFIG, "seed": 0, "backend": "reference", "device_kind": "cpu"}
    connection = expert_parallel_connection(
        window, Role.ATTENTION, 0, str(tmp_path), 10.0, **options, exchange="gloo"
    )
    try:
        assert isinstance(connection, ExpertParallelConnection)
        assert isinstance(connection, PeerlessConnection)
        assert (tmp_path / STORE_FILE).exists()
        _is_peerless_rank_zero(connection, window)
        with pytest.raises(InvalidArgument, match="colocated ranks have no FFN role"):
            connection.ffn_endpoint()
        endpoint = connection.attention_endpoint()
        assert isinstance(endpoint, ExpertParallelEndpoint)
        assert endpoint.rank == 0
        connection.abort()
    finally:
        connection.close()
    connection.close()  # idempotent
    with pytest.raises(InvalidArgument, match="launched as attention ranks"):
        expert_parallel_connection(
            window, Role.FFN, 0, str(tmp_path), 10.0, **options, exchange="gloo"
        )


@pytest.mark.parametrize("record", [ModeResult, ReplicaRecord])
def test_measured_and_simulated_replicas_record_the_same_times(
    record: type[ReplicaTimes],
) -> None:
    """Two replicas of either kind summarise alike: a replica that timed no MoE layer adds
    nothing to the breakdown's means."""
    timed = record(done={0: 2.0}, busy_s=1.5, wait_s=0.5, origin=10.0, batches=[(0, 2, 40)])
    timed.layer_times = {
        "moe_layers": 4,
        "compute_ms_per_layer": 3.0,
        "dispatch_ms_per_layer": 1.0,
        "combine_ms_per_layer": 2.0,
        "barrier_ms_per_layer": 0.0,
    }
    untimed = record(done={1: 4.0}, busy_s=3.0, origin=10.5, dummy_batches=1)
    requests = [Request(0, 40, 0.0, 0), Request(1, 8, 0.0, 1)]
    s = summarize("async", requests, [timed, untimed], [[(10.5, 11.0, 0, 1, 0.25)]])
    assert s.makespan_s == 4.0
    assert s.attention_busy == [1.5 / 4.0, 3.0 / 4.0]
    assert s.dummy_batches == 1
    assert s.breakdown.compute_ms_per_layer == 3.0
    assert s.breakdown.moe_layers == 4.0
    assert s.breakdown.ffn_ms_per_item == 250.0
    assert s.breakdown.ffn_items == 1.0
    other = record(done={0: 2.0}, busy_s=2.0, origin=10.0)
    colocated = summarize("colocated", requests, [other, untimed], [])
    assert colocated.breakdown.empty


def test_an_ffn_rank_is_busy_for_its_items_host_spans_and_their_device_time() -> None:
    """On a CPU the host span holds the compute; on a GPU the host replies once the
    experts are queued, so a 0.8 s item can span 0.1 s of host time, and the next item
    queues behind it on the device. Busy is the union of both, clipped to the mode."""
    replica = ModeResult(done={0: 4.0}, origin=10.0)
    requests = [Request(0, 40, 0.0, 0)]
    intervals = [
        (10.5, 11.0, 0, 1, 0.25),  # CPU-like: 0.5 s of host, 0.25 s of compute inside it
        (12.0, 12.1, 0, 2, 0.8),  # GPU-like: on the device 12.0-12.8
        (12.5, 12.6, 1, 2, 0.6),  # queued behind it: 12.8-13.4
        (9.0, 10.5, 0, 0, 1.5),  # taken before the mode: its last 0.5 s count
        (13.9, 14.0, 0, 3, 0.5),  # runs past the end (14.0): clipped
    ]
    s = summarize("async", requests, [replica], [intervals])
    assert s.ffn_busy == [pytest.approx((0.5 + 0.5 + 1.4 + 0.1) / 4.0)]
    assert s.breakdown.ffn_items == 4.0  # taken during the mode
    assert s.breakdown.ffn_ms_per_item == pytest.approx(1e3 * (0.25 + 0.8 + 0.6 + 0.5) / 4)
    full = [(10.0 + i, 10.1 + i, 0, 0, 2.0) for i in range(4)]  # more work than time
    assert summarize("async", requests, [replica], [full]).ffn_busy == [1.0]


@pytest.mark.parametrize(("kind", "method"), [("cuda", "spawn"), ("cpu", "forkserver")])
def test_a_launch_spawns_its_ranks_on_gpus_and_forks_them_on_the_cpu(
    kind: str, method: str
) -> None:
    import types

    from afd_tools.run.launches import Launch, _started

    def build(plan: object, progress: object) -> Launch:
        return Launch(["async"], [], None, [], None, 1, 1, [])  # type: ignore[arg-type]

    plan = types.SimpleNamespace(placement=types.SimpleNamespace(kind=kind))
    launch = _started(build, plan, None)  # type: ignore[arg-type]
    assert launch.start_method == method
    assert launch.modes == ["async"]
