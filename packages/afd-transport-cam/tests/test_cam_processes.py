"""The CAM emulator across processes: afd's launcher runs each rank in its own process over
shared-memory windows, through the endpoint protocols only (2 replicas of 2 attention ranks,
2 FFN ranks), with and without int8 dispatch; a killed rank fails its peers by name and
leaves nothing behind."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

from afd_protocol import SlotLayout, Topology
from afd_protocol.launch import LaunchError, RankSpec, launch
from afd_protocol.shm.segments import leftover_segments
from afd_transport_cam.emulated import emulated_connection

sys.path.insert(0, str(Path(__file__).parent))
import afd_cam_workers as workers

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine not in ("x86_64", "amd64"),
    reason="the shared-memory windows need Linux on x86-64",
)

LAYERS = 4


def window(per_dp: int = 2, attention: int = 4) -> object:
    topo = Topology(attention, 2, 6, attn_ranks_per_dp=per_dp)
    return SlotLayout(topo, workers.HIDDEN, 16, 2, dtype="float32").window(ring_depth=1)


def specs(
    attention: int = 4, die_after: int | None = None, late_ranks: tuple[int, ...] = ()
) -> list[RankSpec]:
    """Every attention rank runs LAYERS layers; ``late_ranks`` start 1 s after the others
    (20 peer checks later), so the others have shut down and exited by then."""
    tokens = [[16, 3], [16, 3], [1, 9], [1, 9]]  # uneven replicas; members alike
    ranks = [
        RankSpec(
            "attention",
            r,
            workers.attention_linear,
            {
                "seed": 4,
                "layers": LAYERS,
                "tokens": tokens[r],
                "timeout": 20.0,
                "start_after": 1.0 if r in late_ranks else 0.0,
            },
        )
        for r in range(attention)
    ]
    ranks += [
        RankSpec(
            "ffn",
            r,
            workers.ffn_linear,
            {
                "seed": 4,
                "layers": LAYERS,
                "timeout": 20.0,
                "die_after": die_after if r == 1 else None,
            },
        )
        for r in range(2)
    ]
    return ranks


@pytest.mark.parametrize("quant", [False, True])
def test_two_replicas_of_two_ranks_across_processes(quant: bool) -> None:
    before = set(leftover_segments())
    factory = functools.partial(emulated_connection, dynamic_quant=quant, spin_timeout=20.0)
    results = launch(window(), specs(), timeout=120, transport_factory=factory)
    tolerance = 1e-2 if quant else 1e-5
    for r in range(4):
        errors = results[f"attention rank {r}"].value
        assert len(errors) == LAYERS
        assert max(errors) <= tolerance, (r, errors)
    for f in range(2):
        served = results[f"ffn rank {f}"].value
        # Every replica's every layer, each served once by every FFN rank (no chunks here).
        assert sorted(served) == [(rep, layer) for rep in range(2) for layer in range(LAYERS)]
    assert set(leftover_segments()) <= before


def test_a_replica_that_shut_down_and_exited_is_not_taken_for_a_dead_peer() -> None:
    # Replica 1 (attention ranks 2 and 3) announces its shutdown and exits while the FFN
    # ranks still wait for replica 0, which starts a second later: a clean exit after
    # close is not a failure (it was reported as "attention rank 2 ... exited").
    factory = functools.partial(emulated_connection, spin_timeout=20.0)
    results = launch(window(), specs(late_ranks=(0, 1)), timeout=120, transport_factory=factory)
    for r in range(4):
        assert max(results[f"attention rank {r}"].value) <= 1e-5
    for f in range(2):
        served = results[f"ffn rank {f}"].value
        assert sorted(served) == [(rep, layer) for rep in range(2) for layer in range(LAYERS)]


def test_ffn_ranks_stop_by_name_when_every_attention_rank_closed_without_shutdown() -> None:
    factory = functools.partial(emulated_connection, spin_timeout=20.0)
    ranks = [RankSpec("attention", r, workers.attention_leaves) for r in range(4)]
    ranks += [
        RankSpec("ffn", r, workers.ffn_linear, {"seed": 4, "layers": LAYERS, "timeout": 20.0})
        for r in range(2)
    ]
    with pytest.raises(LaunchError) as failure:
        launch(window(), ranks, timeout=60, grace=15, transport_factory=factory)
    for f in range(2):
        error = failure.value.results[f"ffn rank {f}"].error or ""
        assert error.startswith("PeerAborted"), error
        assert "every attention rank closed its connection" in error, error


def test_an_attention_rank_stops_by_name_when_an_ffn_rank_it_waits_for_closed() -> None:
    factory = functools.partial(emulated_connection, spin_timeout=20.0)
    ranks = [
        RankSpec(
            "attention",
            r,
            workers.attention_linear,
            {"seed": 4, "layers": LAYERS, "tokens": [3], "timeout": 20.0},
        )
        for r in range(2)
    ]
    ranks += [
        RankSpec("ffn", 0, workers.ffn_linear, {"seed": 4, "layers": LAYERS, "timeout": 20.0}),
        RankSpec("ffn", 1, workers.ffn_leaves),
    ]
    with pytest.raises(LaunchError) as failure:
        launch(
            window(per_dp=1, attention=2), ranks, timeout=60, grace=15, transport_factory=factory
        )
    errors = [failure.value.results[f"attention rank {r}"].error or "" for r in range(2)]
    assert all(e.startswith("PeerAborted") for e in errors), errors
    assert any(
        "ffn rank 1 closed its connection while this rank waits for its reply" in e for e in errors
    ), errors


def test_a_killed_ffn_rank_fails_its_peers_by_name_and_leaves_nothing() -> None:
    before = set(leftover_segments())
    factory = functools.partial(emulated_connection, spin_timeout=20.0)
    with pytest.raises(LaunchError) as failure:
        launch(window(), specs(die_after=1), timeout=60, grace=15, transport_factory=factory)
    results = failure.value.results
    assert "SIGKILL" in (results["ffn rank 1"].error or "")
    errors = [results[f"attention rank {r}"].error or "" for r in range(4)]
    assert all(e.startswith("PeerAborted") for e in errors), errors
    # The first to notice name the dead rank; others may hear of it from a peer that
    # aborted first, and name that one.
    assert any("ffn rank 1 (pid" in e and "exited" in e for e in errors), errors
    assert set(leftover_segments()) <= before
