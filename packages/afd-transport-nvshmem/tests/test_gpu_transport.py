"""Two processes on two GPUs over NVSHMEM: the endpoint matrix, faults, and equivalence with
the host transport. Skipped without two GPUs and the NVSHMEM library."""

from __future__ import annotations

import time

import afd_nvshmem_workers as workers
import pytest
import torch

from afd_protocol import Role, SlotLayout, Topology
from afd_protocol.host import LaunchError, launch
from afd_protocol.host.launcher import RankSpec, host_transport
from afd_transport_nvshmem import NvshmemUnavailable, find_host_library


def _gpu_ready() -> str | None:
    if torch.cuda.device_count() < 2:
        return "needs two CUDA GPUs"
    try:
        find_host_library()
    except NvshmemUnavailable as exc:
        return str(exc)
    return None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_ready() is not None, reason=_gpu_ready() or ""),
]

LAYERS = 4


def factory():
    from afd_transport_nvshmem.launch_support import nvshmem_transport

    return nvshmem_transport


def window(ring_depth: int = 1, tokens: int = 256, shared: str = "attention"):
    topo = Topology(1, 1, 8)
    return SlotLayout(topo, 256, tokens, 4, dtype="bfloat16", shared_placement=shared).window(
        ring_depth=ring_depth
    )


@pytest.mark.parametrize("wait", ["device", "host"])
@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_endpoint_matrix_on_two_gpus(wait: str, shared: str, monkeypatch) -> None:
    monkeypatch.setenv("AFD_NVSHMEM_WAIT", wait)
    jobs = [
        {"layer": 0, "tokens": 256},
        {"layer": 3, "tokens": 7},  # uneven batches, layers out of order
        {"layer": 1, "tokens": 64},
        {"layer": 2, "tokens": 1},
        {"layer": 0, "tokens": 0},  # an empty batch: nothing sent, nothing waited on
        {"layer": 2, "tokens": 100},
    ]
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_jobs,
            {"layers": LAYERS, "seed": 1, "jobs": jobs, "in_flight": 2, "overflow_first": True},
        ),
        RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 1}),
    ]
    results = launch(
        window(ring_depth=2, shared=shared), specs, timeout=240, transport_factory=factory()
    )
    attention = results["attention rank 0"].value
    assert "257 tokens exceeds token_cap=256" in attention["overflow"]
    assert len(attention["errors"]) == len(jobs)
    assert max(attention["errors"]) <= 2e-2, attention["errors"]
    assert results["ffn rank 0"].value["served"] == len(jobs) - 1  # the empty batch sent nothing
    assert results["ffn rank 0"].value["grouped_mm"] == hasattr(torch, "_grouped_mm")


def test_killed_ffn_rank_fails_the_attention_rank_within_the_timeout() -> None:
    jobs = [{"layer": i % LAYERS, "tokens": 32} for i in range(200)]
    specs = [
        RankSpec(
            Role.ATTENTION, 0, workers.attention_jobs, {"layers": LAYERS, "seed": 2, "jobs": jobs}
        ),
        RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 2, "die_after": 3}),
    ]
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(window(), specs, timeout=240, transport_factory=factory())
    elapsed = time.monotonic() - start
    results = caught.value.results
    assert results["ffn rank 0"].error == "killed by SIGKILL"
    assert results["attention rank 0"].error_type in ("PeerAborted", "PeerTimeout")
    assert elapsed < 120


def test_host_and_nvshmem_transports_agree() -> None:
    jobs = [{"layer": i % LAYERS, "tokens": t} for i, t in enumerate([200, 3, 77, 128])]
    spec_kwargs = {"layers": LAYERS, "seed": 5, "jobs": jobs, "record": True}
    outcomes = {}
    for name, make in (("host", host_transport), ("nvshmem", factory())):
        specs = [
            RankSpec(Role.ATTENTION, 0, workers.attention_jobs, spec_kwargs),
            RankSpec(Role.FFN, 0, workers.ffn_grouped, {"layers": LAYERS, "seed": 5}),
        ]
        outcomes[name] = launch(window(), specs, timeout=240, transport_factory=make)[
            "attention rank 0"
        ].value
    host, gpu = outcomes["host"], outcomes["nvshmem"]
    assert host["plans"] == gpu["plans"]  # identical integer parts
    for a, b in zip(host["outputs"], gpu["outputs"], strict=True):
        rel = float((a - b).norm() / a.norm().clamp_min(1e-12))
        assert rel <= 2e-2
