"""The CAM endpoints through afd's endpoint protocols, every rank in this process over the
emulated operators: results against the float64 reference of afd_protocol.testing, with
replicas of two attention ranks, quantisation, chunking, empty batches, shutdown, and the
deployments CAM cannot run."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from afd_protocol import (
    ConnectorShutdown,
    EndpointOptions,
    ExpertPlacement,
    InvalidArgument,
    PeerTimeout,
    RingExhausted,
    SlotLayout,
    Topology,
    TopologyError,
    relative_error,
)
from afd_protocol.testing import LinearExperts, random_routing
from afd_transport_cam.emulator import ops
from afd_transport_cam.emulator.world import LocalCamWorld, register_world, unregister_world
from afd_transport_cam.endpoints import CamConnection, cam_geometry

HIDDEN = 8
FAST = EndpointOptions(timeout=0.2)
_names = itertools.count()


def layout_of(
    a: int = 4, f: int = 2, experts: int = 6, per_dp: int = 2, tokens: int = 16
) -> SlotLayout:
    topo = Topology(a, f, experts, attn_ranks_per_dp=per_dp)
    return SlotLayout(topo, HIDDEN, tokens, 2, dtype="float32")


class Deployment:
    """Every rank's endpoint over one emulated communicator in this process."""

    def __init__(self, layout: SlotLayout, quant: bool = False) -> None:
        self.layout = layout
        self.group = f"cam-endpoints-{next(_names)}"
        geo = cam_geometry(layout, quant)
        register_world(self.group, LocalCamWorld(geo.world_size, geo.window_bytes, 0.2))
        topo = layout.topology

        def connect(role: str, rank: int) -> CamConnection:
            return CamConnection(layout, role, rank, self.group, dynamic_quant=quant)

        self.attention = [
            connect("attention", r).attention_endpoint(FAST)
            for r in range(topo.num_attention_ranks)
        ]
        self.ffn = [connect("ffn", r).ffn_endpoint(FAST) for r in range(topo.num_ffn_ranks)]
        self.experts = LinearExperts(4, topo.num_experts, HIDDEN, seed=1)

    def close(self) -> None:
        unregister_world(self.group)
        ops._PENDING.clear()


@pytest.fixture
def deploy() -> Iterator[object]:
    made: list[Deployment] = []

    def make(layout: SlotLayout, quant: bool = False) -> Deployment:
        made.append(Deployment(layout, quant))
        return made[-1]

    yield make
    for deployment in made:
        deployment.close()


@pytest.fixture(autouse=True)
def small_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_SIZE_FACTOR", "0.001")


def run_layer(d: Deployment, layer: int, tokens: list[int], seed: int) -> list[float]:
    """Every attention rank dispatches (members of a replica the same layer), the FFN ranks
    serve everything ready, every rank combines; returns each rank's relative error."""
    gen = torch.Generator().manual_seed(seed)
    jobs = []
    for endpoint, n in zip(d.attention, tokens, strict=True):
        x, ids, w = random_routing(n, HIDDEN, 2, range(d.layout.topology.num_experts), gen)
        jobs.append((x, ids, w, endpoint.dispatch(layer, x, ids, w)))
    d.experts.drain(d.ffn)
    errors = []
    for endpoint, (x, ids, w, handle) in zip(d.attention, jobs, strict=True):
        out = endpoint.combine(handle)
        assert out.shape == (x.shape[0], HIDDEN)
        errors.append(relative_error(out, d.experts.reference(layer, x, ids, w, False)))
    return errors


def test_two_replicas_of_two_ranks_match_the_reference_over_several_layers(deploy) -> None:  # type: ignore[no-untyped-def]
    d = deploy(layout_of())
    for layer in range(3):
        errors = run_layer(d, layer, [7, 3, 16, 1], seed=layer)
        assert max(errors) <= 1e-5, errors
    for endpoint in d.attention:
        endpoint.announce_shutdown()
    for ffn in d.ffn:
        with pytest.raises(ConnectorShutdown, match="every attention replica shut down"):
            ffn.next_work_item()


def test_quantised_dispatch_stays_within_the_int8_error(deploy) -> None:  # type: ignore[no-untyped-def]
    d = deploy(layout_of(), quant=True)
    errors = run_layer(d, 1, [9, 9, 4, 12], seed=5)
    assert max(errors) <= 1e-2, errors  # per-token int8: about amax / 254 per element
    assert min(errors) > 1e-6  # and it really was quantised


def test_a_replica_larger_than_the_capacity_comes_as_several_items(  # type: ignore[no-untyped-def]
    deploy, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = deploy(layout_of(a=2, f=1, experts=4, per_dp=2, tokens=32))
    monkeypatch.setenv("BATCH_SIZE_FACTOR", str(40.5 / 262144))  # 40 rows per receive
    gen = torch.Generator().manual_seed(2)
    handles, jobs = [], []
    for endpoint in d.attention:
        x, ids, w = random_routing(32, HIDDEN, 2, range(4), gen)
        jobs.append((x, ids, w))
        handles.append(endpoint.dispatch(2, x, ids, w))
    served = d.experts.drain(d.ffn)
    assert len(served) >= 3  # 128 rows in chunks of whole experts <= 40 rows
    assert {layer for _, _, layer in served} == {2}
    for endpoint, (x, ids, w), handle in zip(d.attention, jobs, handles, strict=True):
        out = endpoint.combine(handle)
        assert relative_error(out, d.experts.reference(2, x, ids, w, False)) <= 1e-5


def test_the_rules_cam_imposes_are_clear_errors(deploy) -> None:  # type: ignore[no-untyped-def]
    d = deploy(layout_of(a=2, f=2, per_dp=1))
    attention = d.attention[0]
    x, ids, w = random_routing(3, HIDDEN, 2, range(6), torch.Generator().manual_seed(0))
    handle = attention.dispatch(0, x, ids, w)
    with pytest.raises(RingExhausted, match="one dispatch in flight per attention rank"):
        attention.dispatch(1, x, ids, w, stage=1)
    with pytest.raises(PeerTimeout, match="replies from every FFN rank"):
        attention.combine(handle, timeout=0.01)  # nobody served it yet
    d.experts.drain(d.ffn)
    out = attention.combine(handle)  # the same handle, after the timeout
    assert relative_error(out, d.experts.reference(0, x, ids, w, False)) <= 1e-5
    with pytest.raises(InvalidArgument, match="not in flight"):
        attention.combine(handle)
    # An empty batch travels as one zero token and combines to [0, H].
    empty = attention.dispatch(1, x[:0], ids[:0], w[:0])
    d.experts.drain(d.ffn)
    assert attention.combine(empty).shape == (0, HIDDEN)
    # The FFN side: a reply of the wrong shape, or with shared rows, is refused.
    handle = attention.dispatch(2, x, ids, w)
    item = d.ffn[0].next_work_item()
    rows = item.num_routed_rows
    with pytest.raises(InvalidArgument, match="routed_out has shape"):
        d.ffn[0].reply(item, torch.zeros(rows + 1, HIDDEN))
    with pytest.raises(InvalidArgument, match="no shared-expert rows"):
        d.ffn[0].reply(item, torch.zeros(rows, HIDDEN), torch.zeros(1, HIDDEN))
    with pytest.raises(InvalidArgument, match="reply to the work item in service first"):
        d.ffn[0].next_work_item()
    d.experts.reply_to(d.ffn[0], item)
    d.experts.drain(d.ffn)
    attention.combine(handle)


def test_deployments_cam_cannot_run_are_refused_naming_why() -> None:
    uneven = Topology(2, 2, 5)  # 3 + 2 experts
    with pytest.raises(TopologyError, match="must split evenly and contiguously"):
        cam_geometry(SlotLayout(uneven, HIDDEN, 16, 2, dtype="float32"))
    shuffled = Topology(2, 2, 4, placement=ExpertPlacement.from_table([[0, 2], [1, 3]]))
    with pytest.raises(TopologyError, match="must split evenly and contiguously"):
        cam_geometry(SlotLayout(shuffled, HIDDEN, 16, 2, dtype="float32"))
    shared = SlotLayout(Topology(2, 2, 4), HIDDEN, 16, 2, dtype="float32", shared_placement="ffn")
    with pytest.raises(TopologyError, match="routed experts only"):
        cam_geometry(shared)
    geo = cam_geometry(layout_of(tokens=16, per_dp=2))
    assert (geo.max_seq_len, geo.tp_size, geo.experts_per_rank) == (32, 2, 3)
