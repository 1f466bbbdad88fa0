"""Processes over NVSHMEM: the endpoint matrix, faults, and equivalence with the
shared-memory transport. One GPU per rank where there are enough GPUs; otherwise the ranks
share a GPU as clients of a private CUDA MPS daemon (``gpu_placement`` in conftest.py), which
runs the same code paths (rows then move through HBM, not NVLink). Skipped without a GPU
and the NVSHMEM library."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import afd_nvshmem_workers as workers
import pytest
import torch

from afd_protocol import Role, SlotLayout, Topology
from afd_protocol.launch import LaunchError, RankSpec, launch, shm_transport
from afd_transport_nvshmem import NvshmemUnavailable, find_host_library


def _gpu_ready() -> str | None:
    if torch.cuda.device_count() < 1:
        return "needs a CUDA GPU"
    try:
        find_host_library()
    except NvshmemUnavailable as exc:
        return str(exc)
    return None


def _placed(specs: list[RankSpec], placement) -> list[RankSpec]:  # type: ignore[no-untyped-def]
    """``specs`` with each rank's environment for the GPUs there are."""
    envs = placement(len(specs))
    return [replace(spec, env={**spec.env, **env}) for spec, env in zip(specs, envs, strict=True)]


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_ready() is not None, reason=_gpu_ready() or ""),
]

LAYERS = 4


def factory(
    wait: str = "device", publish: str = "stream", graphs: int = 0, data_path: str = "mapped"
):
    from afd_transport_nvshmem import NvshmemOptions
    from afd_transport_nvshmem.launch_support import nvshmem_transport

    options = NvshmemOptions(
        wait=wait, publish=publish, exchange_graphs=graphs, data_path=data_path
    )
    return partial(nvshmem_transport, options=options)


def window(
    ring_depth: int = 1, tokens: int = 256, shared: str = "attention", num_ffn_ranks: int = 1
):
    topo = Topology(1, num_ffn_ranks, 8)
    return SlotLayout(topo, 256, tokens, 4, dtype="bfloat16", shared_placement=shared).window(
        ring_depth=ring_depth
    )


@pytest.mark.parametrize(
    ("wait", "shared", "publish"),
    [
        ("device", "attention", "stream"),
        ("device", "ffn", "stream"),
        ("host", "attention", "stream"),
        ("host", "ffn", "stream"),
        ("device", "attention", "kernel"),  # every flag of a dispatch set by one launch
    ],
)
def test_endpoint_matrix(wait: str, shared: str, publish: str, gpu_placement) -> None:  # type: ignore[no-untyped-def]
    jobs = [
        {"layer": 0, "tokens": 256},
        {"layer": 3, "tokens": 7},  # uneven batches, layers out of order
        {"layer": 1, "tokens": 64},
        {"layer": 2, "tokens": 1},
        {"layer": 0, "tokens": 0},  # an empty batch: nothing sent, nothing waited on
        {"layer": 2, "tokens": 100},
    ]
    # With device waits, neither side may block on the GPU per item: taking a work item and
    # replying on the FFN side, and combining on the attention side, run with CUDA's sync
    # debug mode set to "error", and every arrived header must come from the wait's capture.
    strict = wait == "device"
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_jobs,
            {
                "layers": LAYERS,
                "seed": 1,
                "jobs": jobs,
                "in_flight": 2,
                "overflow_first": True,
                "check_no_sync": strict,
            },
        ),
        RankSpec(
            Role.FFN,
            0,
            workers.ffn_grouped,
            {"layers": LAYERS, "seed": 1, "check_no_sync": strict},
        ),
    ]
    results = launch(
        window(ring_depth=2, shared=shared),
        _placed(specs, gpu_placement),
        timeout=240,
        transport_factory=factory(wait, publish),
    )
    attention = results["attention rank 0"].value
    ffn = results["ffn rank 0"].value
    assert "257 tokens exceeds token_cap=256" in attention["overflow"]
    assert len(attention["errors"]) == len(jobs)
    assert max(attention["errors"]) <= 2e-2, attention["errors"]
    assert ffn["served"] == len(jobs) - 1  # the empty batch sent nothing
    assert ffn["grouped_mm"] == hasattr(torch, "_grouped_mm")
    # The layer index as the device sees it, read from the landed header.
    assert [layers[0] for layers in ffn["layers_on_device"]] == [
        job["layer"] for job in jobs if job["tokens"]
    ]
    if strict:
        assert ffn["header_reads"].get("copied", 0) == 0, ffn["header_reads"]
        assert ffn["header_reads"]["captured"] >= ffn["served"] + 1  # items and the shutdown
        assert attention["header_reads"].get("copied", 0) == 0, attention["header_reads"]
        assert attention["header_reads"]["captured"] >= len(jobs) - 1
    else:
        assert ffn["header_reads"].get("captured", 0) == 0
        assert ffn["header_reads"]["copied"] >= ffn["served"] + 1


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_graph_replayed_exchange_matches_the_reference(shared: str, gpu_placement) -> None:  # type: ignore[no-untyped-def]
    """``NvshmemOptions(exchange_graphs=4)``: each (token count, ring) runs eagerly once,
    then its dispatch and combine are captured and replayed; every output matches the
    reference, with the combine free of host synchronisation."""
    counts = [64] * 8 + [100] * 4 + [7] * 4 + [64] * 2
    jobs = [{"layer": i % LAYERS, "tokens": n} for i, n in enumerate(counts)]
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_jobs,
            {"layers": LAYERS, "seed": 3, "jobs": jobs, "in_flight": 2, "check_no_sync": True},
        ),
        RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 3}),
    ]
    results = launch(
        window(ring_depth=2, shared=shared),
        _placed(specs, gpu_placement),
        timeout=240,
        transport_factory=factory(graphs=4),
    )
    attention = results["attention rank 0"].value
    assert len(attention["errors"]) == len(jobs)
    assert max(attention["errors"]) <= 2e-2, attention["errors"]
    # Two stages in flight use both rings: 3 counts x 2 rings eager, the other 12 replayed.
    assert attention["graph_replays"] == len(jobs) - 6
    assert results["ffn rank 0"].value["served"] == len(jobs)


def test_deferred_checks_let_the_host_run_ahead_and_still_match_the_reference(
    gpu_placement,
) -> None:  # type: ignore[no-untyped-def]
    """``defer_checks``: after a stall of the stream the host issues a burst of eight
    layers on one ring, at two token counts in turn; the first combine returns while the
    stall still runs, so the next dispatch stages its words while the one before has not
    been replayed yet -- at the same count (the same graphs' words) and at the other (the
    ring's flag values, which the transport shares between counts). Each replay must
    still send its own header words and flags (the FFN rank refuses a slot whose header
    and flag disagree), and every output matches the reference."""
    bursts, burst_len = 6, 8
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_deferred_bursts,
            {
                "layers": LAYERS,
                "seed": 4,
                "tokens": [64, 48],
                "bursts": bursts,
                "burst_len": burst_len,
                "stall_s": 0.02,
            },
        ),
        RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 4}),
    ]
    results = launch(
        window(ring_depth=1),
        _placed(specs, gpu_placement),
        timeout=240,
        transport_factory=factory(graphs=4),
    )
    attention = results["attention rank 0"].value
    assert len(attention["errors"]) == bursts * burst_len
    assert max(attention["errors"]) <= 2e-2, attention["errors"]
    # The first use of each count is eager, the second captures (a replay).
    assert attention["graph_replays"] == bursts * burst_len - 2
    # Past the first burst (eager, then the capture) the host was ahead of the stall.
    assert attention["ahead"] >= bursts - 1, attention
    assert results["ffn rank 0"].value["served"] == bursts * burst_len


@pytest.mark.parametrize(("graphs", "data_path"), [(0, "mapped"), (4, "mapped"), (0, "put")])
def test_killed_ffn_rank_fails_the_attention_rank_within_the_timeout(
    graphs: int, data_path: str, private_gpu_placement
) -> None:  # type: ignore[no-untyped-def]
    """Also while the attention side replays its exchange from CUDA graphs, and over the put
    path."""
    jobs = [{"layer": i % LAYERS, "tokens": 32} for i in range(200)]
    specs = [
        RankSpec(
            Role.ATTENTION, 0, workers.attention_jobs, {"layers": LAYERS, "seed": 2, "jobs": jobs}
        ),
        RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 2, "die_after": 3}),
    ]
    with pytest.raises(LaunchError) as caught:
        launch(
            window(),
            _placed(specs, private_gpu_placement),
            timeout=240,
            transport_factory=factory(graphs=graphs, data_path=data_path),
        )
    results = caught.value.results
    assert results["ffn rank 0"].error == "killed by SIGKILL"
    # Found dead by the liveness check, not by waiting out the 60 s timeout (a PeerTimeout).
    assert results["attention rank 0"].error_type == "PeerAborted"


def test_shm_and_nvshmem_transports_agree(gpu_placement) -> None:  # type: ignore[no-untyped-def]
    jobs = [{"layer": i % LAYERS, "tokens": t} for i, t in enumerate([200, 3, 77, 128])]
    spec_kwargs = {"layers": LAYERS, "seed": 5, "jobs": jobs, "record": True}
    outcomes = {}
    for name, make in (("shm", shm_transport), ("nvshmem", factory())):
        specs = [
            RankSpec(Role.ATTENTION, 0, workers.attention_jobs, spec_kwargs),
            RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 5}),
        ]
        placed = _placed(specs, gpu_placement)
        outcomes[name] = launch(window(), placed, timeout=240, transport_factory=make)[
            "attention rank 0"
        ].value
    host, gpu = outcomes["shm"], outcomes["nvshmem"]
    assert host["plans"] == gpu["plans"]  # identical integer parts
    for a, b in zip(host["outputs"], gpu["outputs"], strict=True):
        rel = float((a - b).norm() / a.norm().clamp_min(1e-12))
        assert rel <= 2e-2


def test_ranks_sharing_a_gpu_without_mps_are_refused_at_start_up() -> None:
    """More ranks than GPUs and no MPS: every rank refuses at start-up, naming the ranks and
    saying how to start MPS, instead of aborting or hanging inside NVSHMEM (limited MPG)."""
    gpus = torch.cuda.device_count()
    specs = [
        RankSpec(Role.ATTENTION, 0, workers.attention_jobs, {"layers": 1, "seed": 0, "jobs": []}),
        *(
            RankSpec(Role.FFN, f, workers.ffn_grouped, {"layers": 1, "seed": 0})
            for f in range(gpus)
        ),
    ]
    no_mps = {"CUDA_MPS_PIPE_DIRECTORY": "/nonexistent/afd-no-mps"}
    specs = [replace(spec, env=no_mps) for spec in specs]
    with pytest.raises(LaunchError) as caught:
        launch(window(num_ffn_ranks=gpus), specs, timeout=90, transport_factory=factory())
    last = f"ffn rank {gpus - 1}"
    for result in caught.value.results.values():
        assert result.error_type == "TopologyError", result.error
        assert f"attention rank 0 and {last} would share a GPU" in (result.error or "")
        assert "not CUDA MPS clients" in (result.error or "")
        assert "nvidia-cuda-mps-control -d" in (result.error or "")


@pytest.mark.parametrize("device_pack", [False, None])
def test_ffn_rank_that_receives_nothing_is_not_waited_on(gpu_placement, device_pack) -> None:  # type: ignore[no-untyped-def]
    """1 attention x 2 FFN ranks. With the dispatch planned on the host, jobs routed only to
    experts 0-3 (FFN rank 0) do not wait for FFN rank 1, which then serves only the job
    that reaches its experts. The device pack (the default) never reads the counts on the
    host, so it sends every FFN rank its (possibly empty) part and waits for every reply:
    the outputs are the same."""
    only_first = [0, 1, 2, 3]
    jobs = [
        {"layer": 0, "tokens": 64, "experts": only_first},
        {"layer": 1, "tokens": 9, "experts": only_first},
        {"layer": 2, "tokens": 128},
        {"layer": 3, "tokens": 5, "experts": only_first},
    ]
    attention_kwargs = {
        "layers": LAYERS,
        "seed": 3,
        "jobs": jobs,
        "record": True,
        "device_pack": device_pack,
    }
    specs = [
        RankSpec(Role.ATTENTION, 0, workers.attention_jobs, attention_kwargs),
        RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 3}),
        RankSpec(Role.FFN, 1, workers.ffn_grouped, {"layers": LAYERS, "seed": 3}),
    ]
    results = launch(
        window(num_ffn_ranks=2),
        _placed(specs, gpu_placement),
        timeout=90,
        transport_factory=factory(),
    )
    attention = results["attention rank 0"].value
    assert max(attention["errors"]) <= 2e-2, attention["errors"]
    waited_on = [expected for expected, _, _ in attention["plans"]]
    assert results["ffn rank 0"].value["served"] == 4
    if device_pack is False:
        assert waited_on == [[0], [0], [0, 1], [0]]
        assert results["ffn rank 1"].value["served"] == 1
    else:
        assert waited_on == [[0, 1]] * 4


@pytest.mark.parametrize("graphs", [0, 4])
def test_the_put_path_gives_the_mapped_paths_outputs(graphs: int, gpu_placement) -> None:  # type: ignore[no-untyped-def]
    """``NvshmemOptions(data_path="put")``: slots staged locally, then NVSHMEM device puts of
    the used extents and the flag. 1 attention x 2 FFN ranks, shared rows on the FFN side,
    two stages in flight, an empty batch; eagerly and graph-replayed (the puts captured):
    every output bitwise equal to the mapped path's, with the same plans."""
    tokens = [200, 3, 77, 128, 0, 64, 64, 64, 64, 64]
    jobs = [{"layer": i % LAYERS, "tokens": t} for i, t in enumerate(tokens)]
    outcomes = {}
    for path in ("mapped", "put"):
        specs = [
            RankSpec(
                Role.ATTENTION,
                0,
                workers.attention_jobs,
                {"layers": LAYERS, "seed": 8, "jobs": jobs, "in_flight": 2, "record": True},
            ),
            RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 8}),
            RankSpec(Role.FFN, 1, workers.ffn_grouped, {"layers": LAYERS, "seed": 8}),
        ]
        results = launch(
            window(ring_depth=2, shared="ffn", num_ffn_ranks=2),
            _placed(specs, gpu_placement),
            timeout=240,
            transport_factory=factory(graphs=graphs, data_path=path),
        )
        outcomes[path] = results["attention rank 0"].value
    mapped, put = outcomes["mapped"], outcomes["put"]
    assert max(put["errors"]) <= 2e-2, put["errors"]
    assert put["plans"] == mapped["plans"]
    assert len(put["outputs"]) == len(jobs)
    for a, b in zip(mapped["outputs"], put["outputs"], strict=True):
        assert torch.isfinite(b).all()
        assert torch.equal(a, b)
    if graphs:
        assert put["graph_replays"] == mapped["graph_replays"] > 0
