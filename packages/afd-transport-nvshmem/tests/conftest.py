"""Make the GPU worker module importable by spawned rank processes, and place ranks on the
GPUs there are: one each where there are enough, otherwise several on one GPU as clients of
a private CUDA MPS daemon (NVSHMEM's full multi-process-per-GPU mode), started once for the
session and stopped at its end."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

Placement = Callable[[int], list[dict[str, str]]]
"""``placement(ranks)``: each rank's extra environment (``RankSpec.env``)."""


def _placement() -> Iterator[Placement]:
    """A placement whose MPS daemon (started on first use) is stopped when it is closed."""
    import torch

    from afd_transport_nvshmem.mps import MpsDaemon, equal_shares

    daemon: MpsDaemon | None = None

    def place(ranks: int) -> list[dict[str, str]]:
        nonlocal daemon
        gpus = torch.cuda.device_count()
        if ranks <= gpus:
            return [{} for _ in range(ranks)]
        if daemon is None:
            daemon = MpsDaemon.start()
        per_gpu = -(-ranks // gpus)
        return [daemon.client_environment(equal_shares(per_gpu)) for _ in range(ranks)]

    try:
        yield place
    finally:
        if daemon is not None:
            daemon.close()


@pytest.fixture(scope="session")
def gpu_placement() -> Iterator[Placement]:
    """One MPS daemon for the session's well-behaved tests."""
    yield from _placement()


@pytest.fixture
def private_gpu_placement() -> Iterator[Placement]:
    """A daemon of the test's own, for a test that kills a rank: after a client dies with
    work in flight the MPS server refuses every new client ("CUDA-capable device(s) is/are
    busy or unavailable") until it has cleaned up, which made the next test on a shared
    daemon fail at ``set_device`` (seen twice on one H200). Closing the daemon waits for its
    server to exit, so the fault stays with the test that caused it."""
    yield from _placement()
