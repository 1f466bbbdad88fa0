"""The FFN compute in graph mode over the emulated CAM operators, driven by the one serving
loop (afd_protocol.serve): the experts only ever see bucket-sized buffers (one shape per
bucket, the same tensor each time), the layer comes from the device-side index, every
combined output matches a float64 SwiGLU reference, and the loop's timeout and stats apply."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from afd_protocol import (
    EndpointOptions,
    PeerTimeout,
    ServeStats,
    SlotLayout,
    Topology,
    relative_error,
    serve,
)
from afd_protocol.testing import random_routing
from afd_transport_cam.emulator import ops
from afd_transport_cam.emulator.world import LocalCamWorld, register_world, unregister_world
from afd_transport_cam.endpoints import CamConnection, cam_geometry
from afd_transport_cam.graph_ffn import LayeredSwiGLUExperts, StaticShapeFFN, bucket_sizes

H, INTER, E, F, LAYERS = 8, 6, 4, 2, 3
R = E // F


@pytest.fixture(autouse=True)
def small_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_SIZE_FACTOR", str(100.5 / 262144))  # 100-row receives


def weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(LAYERS, E, H, 2 * INTER, generator=gen) / H**0.5
    down = torch.randn(LAYERS, E, INTER, H, generator=gen) / INTER**0.5
    return gate_up, down


def reference(x, ids, w, layer, gate_up, down) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = x[t].double() @ gate_up[layer, e].double()
            a = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
            out[t] += float(w[t, k]) * (a @ down[layer, e].double())
    return out


@contextmanager
def cam_world(group: str, spin_timeout: float) -> Iterator[SlotLayout]:
    """Two attention replicas and ``F`` FFN ranks in one emulated CAM world (registered as
    ``group`` while in use); yields their slot layout (hidden ``H``, 32 tokens, top-2)."""
    layout = SlotLayout(Topology(2, F, E), H, 32, 2, dtype="float32")
    geo = cam_geometry(layout)
    register_world(group, LocalCamWorld(geo.world_size, geo.window_bytes, spin_timeout))
    try:
        yield layout
    finally:
        unregister_world(group)
        ops._PENDING.clear()


def test_bucket_sizes_are_powers_of_two_up_to_the_capacity() -> None:
    assert bucket_sizes(100) == (16, 32, 64, 100)
    assert bucket_sizes(16) == (16,)
    assert bucket_sizes(5, smallest=2) == (2, 4, 5)


def test_graph_mode_serves_with_static_shapes_and_matches_the_reference() -> None:
    group = "cam-graph-ffn"
    with cam_world(group, 0.2) as layout:
        options = EndpointOptions(timeout=0.2)
        attention = [
            CamConnection(layout, "attention", a, group).attention_endpoint(options)
            for a in range(2)
        ]
        gate_up, down = weights(3)
        loops = []
        for m in range(F):
            mine = slice(m * R, (m + 1) * R)
            experts = LayeredSwiGLUExperts(
                [gate_up[layer, mine] for layer in range(LAYERS)],
                [down[layer, mine] for layer in range(LAYERS)],
            )
            endpoint = CamConnection(layout, "ffn", m, group).ffn_endpoint(options)
            loops.append(StaticShapeFFN(endpoint, experts, H, capacity=100))
        gen = torch.Generator().manual_seed(4)
        for layer, sizes in enumerate([(3, 30), (17, 1), (32, 32)]):
            jobs = []
            for endpoint, n in zip(attention, sizes, strict=True):
                x, ids, w = random_routing(n, H, 2, range(E), gen)
                jobs.append((x, ids, w, endpoint.dispatch(layer, x, ids, w)))
            for loop in loops:
                stats = serve(loop.endpoint, loop, max_items=2)  # one item per replica
                assert len(stats.items) == 2
            for endpoint, (x, ids, w, handle) in zip(attention, jobs, strict=True):
                out = endpoint.combine(handle)
                error = relative_error(out, reference(x, ids, w, layer, gate_up, down))
                assert error <= 1e-5, (layer, error)
        for loop in loops:
            # Only bucket shapes reached the experts, and each bucket is one buffer.
            assert loop.shapes <= {(size, H) for size in loop.buckets}
            assert len(loop.shapes) >= 2
            first = loop.buffer(loop.buckets[0]).data_ptr()
            assert loop.buffer(loop.buckets[0]).data_ptr() == first
        for endpoint in attention:
            endpoint.announce_shutdown()
        # shutdown ends the loop
        assert [len(serve(loop.endpoint, loop).items) for loop in loops] == [0, 0]


def test_graph_mode_gets_the_serving_loops_timeout_and_stats() -> None:
    """A replica that never sends: the graph-mode compute, driven by the one loop, raises
    PeerTimeout after the loop's timeout (not the endpoint's 30 s), and the stats it was
    given count the item served before."""
    group = "cam-graph-ffn-timeout"
    with cam_world(group, 30.0) as layout:
        options = EndpointOptions(timeout=30.0)
        attention = CamConnection(layout, "attention", 0, group).attention_endpoint(options)
        # Attention rank 1 (replica 1) never sends.
        gate_up, down = weights(5)
        endpoint = CamConnection(layout, "ffn", 0, group).ffn_endpoint(options)
        experts = LayeredSwiGLUExperts(
            [gate_up[layer, :R] for layer in range(LAYERS)],
            [down[layer, :R] for layer in range(LAYERS)],
        )
        loop = StaticShapeFFN(endpoint, experts, H, capacity=100)
        gen = torch.Generator().manual_seed(6)
        x, ids, w = random_routing(20, H, 2, range(R), gen)  # every choice on FFN rank 0
        attention.dispatch(1, x, ids, w)
        stats = ServeStats()
        start = time.monotonic()
        with pytest.raises(PeerTimeout):
            serve(endpoint, loop, timeout=0.3, stats=stats)
        waited = time.monotonic() - start
        assert 0.3 <= waited < 10.0, waited
        assert stats.served == [(0, 1, 0)]
        assert stats.routed_rows == 40  # 20 tokens x top-2, all on this rank
        assert stats.per_replica(2) == [1, 0]
        assert loop.shapes == {(64, H)}
