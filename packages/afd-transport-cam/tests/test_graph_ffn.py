"""The FFN loop in graph mode over the emulated CAM operators: the experts only ever see
bucket-sized buffers (one shape per bucket, the same tensor each time), the layer comes
from the device-side index, and every combined output matches a float64 SwiGLU reference."""

from __future__ import annotations

import pytest
import torch

from afd_protocol import EndpointOptions, SlotLayout, Topology, relative_error
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


def test_bucket_sizes_are_powers_of_two_up_to_the_capacity() -> None:
    assert bucket_sizes(100) == (16, 32, 64, 100)
    assert bucket_sizes(16) == (16,)
    assert bucket_sizes(5, smallest=2) == (2, 4, 5)


def test_graph_mode_serves_with_static_shapes_and_matches_the_reference() -> None:
    topo = Topology(2, F, E)
    layout = SlotLayout(topo, H, 32, 2, dtype="float32")
    geo = cam_geometry(layout)
    group = "cam-graph-ffn"
    register_world(group, LocalCamWorld(geo.world_size, geo.window_bytes, 0.2))
    try:
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
                assert loop.serve(iterations=2) == 2  # one item per replica
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
        assert [loop.serve() for loop in loops] == [0, 0]  # shutdown ends the loop
    finally:
        unregister_world(group)
        ops._PENDING.clear()
