"""The graphed FFN loop (:class:`GraphedFFNServer`) over NVSHMEM, with real CUDA graphs:
processes placed as in ``test_gpu_transport.py`` (one GPU per rank, or ranks sharing one GPU
under a private CUDA MPS daemon). Outputs against the float64 reference with the attention
side eager and graph-replayed, 1A1F and 2A1F, every wire format; bitwise equal to the eager
FFN endpoint running the same expert step (float32); a killed attention rank is a named
error within the timeout while the FFN side spins in its graph. Skipped without a GPU and
the NVSHMEM library."""

from __future__ import annotations

import afd_nvshmem_workers as workers
import pytest
import torch
from test_gpu_transport import _gpu_ready, _placed, factory

from afd_protocol import Role, SlotLayout, Topology
from afd_protocol.launch import LaunchError, RankSpec, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_ready() is not None, reason=_gpu_ready() or ""),
]

LAYERS = 4
FORMATS = [("per_choice", "attention"), ("per_rank", "attention"), ("per_rank", "ffn")]


def layout(a: int, wire: str, reduce: str, dtype: str = "bfloat16") -> SlotLayout:
    return SlotLayout(
        Topology(a, 1, 8),
        256,
        256,
        4,
        dtype=dtype,
        wire_format=wire,
        combine_reduce=reduce,
    )


def jobs_of(counts: list[int]) -> list[dict[str, int]]:
    return [{"layer": i % LAYERS, "tokens": n} for i, n in enumerate(counts)]


@pytest.mark.parametrize(
    ("wire", "reduce", "attention_graphs"),
    [("per_choice", "attention", 0), ("per_rank", "attention", 4), ("per_rank", "ffn", 4)],
)
def test_graphed_ffn_matches_the_reference(
    wire: str, reduce: str, attention_graphs: int, gpu_placement
) -> None:  # type: ignore[no-untyped-def]
    """1A1F, two stages in flight, token counts that repeat (graph-replayed attention) and
    change; the FFN side serves everything from one graph of four steps."""
    jobs = jobs_of([64] * 8 + [100] * 4 + [7, 256, 1, 64])
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_jobs,
            {"layers": LAYERS, "seed": 4, "jobs": jobs, "in_flight": 2},
        ),
        RankSpec(Role.FFN, 0, workers.ffn_graphed, {"layers": LAYERS, "seed": 4}),
    ]
    results = launch(
        layout(1, wire, reduce).window(ring_depth=2),
        _placed(specs, gpu_placement),
        timeout=240,
        transport_factory=factory(publish="kernel", graphs=attention_graphs),
    )
    attention = results["attention rank 0"].value
    ffn = results["ffn rank 0"].value
    assert len(attention["errors"]) == len(jobs)
    assert max(attention["errors"]) <= 2e-2, attention["errors"]
    assert ffn["served"] == len(jobs)
    assert ffn["sequence"] == len(jobs)  # one reply each, numbered on the device
    assert ffn["replays"] >= len(jobs) // 4


def test_two_replicas_share_the_graphed_ffn_rank(gpu_placement) -> None:  # type: ignore[no-untyped-def]
    """2A1F: both replicas' items are served (in turn while both are ready) and right."""
    jobs = jobs_of([32, 128, 5, 64, 200, 17, 64, 64])
    specs = [
        RankSpec(
            Role.ATTENTION,
            a,
            workers.attention_jobs,
            {"layers": LAYERS, "seed": 6, "jobs": jobs, "in_flight": 2},
        )
        for a in range(2)
    ]
    specs.append(RankSpec(Role.FFN, 0, workers.ffn_graphed, {"layers": LAYERS, "seed": 6}))
    results = launch(
        layout(2, "per_rank", "ffn").window(ring_depth=2),
        _placed(specs, gpu_placement),
        timeout=240,
        transport_factory=factory(publish="kernel", graphs=4),
    )
    for a in range(2):
        errors = results[f"attention rank {a}"].value["errors"]
        assert len(errors) == len(jobs)
        assert max(errors) <= 2e-2, errors
    ffn = results["ffn rank 0"].value
    assert ffn["served"] == 2 * len(jobs)
    assert sorted(set(ffn["replicas"])) == [0, 1]


@pytest.mark.parametrize(("wire", "reduce"), [FORMATS[0], FORMATS[2]])
def test_graphed_ffn_equals_the_eager_endpoint_bitwise(
    wire: str, reduce: str, gpu_placement
) -> None:  # type: ignore[no-untyped-def]
    """float32, an elementwise expert step: the graphed loop's replies, combined by the
    attention side, equal those of the eager window FFN endpoint running the same step."""
    jobs = jobs_of([64, 64, 9, 200, 64, 1])
    outputs = {}
    for eager in (True, False):
        specs = [
            RankSpec(
                Role.ATTENTION,
                0,
                workers.attention_jobs,
                {"layers": LAYERS, "seed": 8, "jobs": jobs, "in_flight": 2, "record": True},
            ),
            RankSpec(
                Role.FFN,
                0,
                workers.ffn_graphed,
                {"layers": LAYERS, "seed": 8, "experts": "affine", "eager": eager},
            ),
        ]
        results = launch(
            layout(1, wire, reduce, "float32").window(ring_depth=2),
            _placed(specs, gpu_placement),
            timeout=240,
            transport_factory=factory(publish="kernel"),
        )
        outputs[eager] = results["attention rank 0"].value["outputs"]
    for want, got in zip(outputs[True], outputs[False], strict=True):
        assert torch.isfinite(got).all()
        assert torch.equal(want, got)


def test_killed_attention_rank_fails_the_graphed_ffn_within_the_timeout(  # type: ignore[no-untyped-def]
    private_gpu_placement,
) -> None:
    """The FFN rank spins in its graph's device waits; the host's liveness check between
    them names the dead attention rank (PeerAborted), long before the 60 s timeout."""
    jobs = jobs_of([32] * 50)
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_jobs,
            {"layers": LAYERS, "seed": 2, "jobs": jobs, "die_after": 5},
        ),
        RankSpec(Role.FFN, 0, workers.ffn_graphed, {"layers": LAYERS, "seed": 2}),
    ]
    with pytest.raises(LaunchError) as caught:
        launch(
            layout(1, "per_rank", "ffn").window(),
            _placed(specs, private_gpu_placement),
            timeout=240,
            transport_factory=factory(publish="kernel", graphs=4),
        )
    results = caught.value.results
    assert results["attention rank 0"].error == "killed by SIGKILL"
    assert results["ffn rank 0"].error_type == "PeerAborted", results["ffn rank 0"].error
    assert "attention rank 0" in (results["ffn rank 0"].error or "")
