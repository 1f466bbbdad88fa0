"""The shared-memory transport end to end: real processes (spawn), linear experts."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import afd_shm_workers as workers
import pytest

from afd_protocol import SEQ_LIMIT, Role, SlotLayout, Topology
from afd_protocol.launch import STOPPED_BY_SIGNAL, LaunchError, RankResult, RankSpec, launch
from afd_protocol.shm import leftover_segments

LAYERS = 4


def layout(
    a: int,
    f: int,
    *,
    experts: int = 7,
    topk: int = 3,
    shared: str = "attention",
    dtype: str = "float32",
    per_dp: int = 1,
    ring_depth: int = 1,
    tokens: int = 48,
    wire: str = "per_choice",
    reduce: str = "attention",
):
    topo = Topology(a, f, experts, attn_ranks_per_dp=per_dp)
    slot = SlotLayout(
        topo,
        16,
        tokens,
        topk,
        dtype=dtype,
        shared_placement=shared,
        wire_format=wire,
        combine_reduce=reduce,
    )
    return slot.window(ring_depth=ring_depth)


def ffn_specs(f: int, **kwargs):
    return [
        RankSpec(Role.FFN, r, workers.ffn_linear, {"seed": 3, "layers": LAYERS, **kwargs})
        for r in range(f)
    ]


@pytest.mark.parametrize(
    ("shared", "dtype", "tolerance", "wire", "reduce"),
    [
        ("ffn", "float32", 1e-5, "per_choice", "attention"),
        ("attention", "bfloat16", 2e-2, "per_choice", "attention"),
        ("ffn", "float32", 1e-5, "per_rank", "ffn"),
        ("attention", "bfloat16", 2e-2, "per_rank", "attention"),
    ],
)
def test_two_by_two_uneven_replicas_on_different_layers(
    shared, dtype, tolerance, wire, reduce
) -> None:
    window = layout(2, 2, shared=shared, dtype=dtype, ring_depth=2, wire=wire, reduce=reduce)
    ffn0 = list(window.slot.topology.local_experts(0))
    # Rank 0: long batches, layers in order. Rank 1: short batches, layers backwards, two
    # stages in flight, and one layer whose tokens all go to FFN rank 0.
    rank0 = [{"layer": layer, "tokens": 48} for layer in range(LAYERS)]
    rank1 = [{"layer": layer, "tokens": 5 + layer} for layer in reversed(range(LAYERS))]
    rank1.insert(1, {"layer": 1, "tokens": 6, "experts": ffn0})
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_linear,
            {"seed": 3, "layers": LAYERS, "jobs": rank0},
        ),
        RankSpec(
            Role.ATTENTION,
            1,
            workers.attention_linear,
            {"seed": 3, "layers": LAYERS, "jobs": rank1, "in_flight": 2},
        ),
        *ffn_specs(2),
    ]
    results = launch(window, specs, timeout=120)
    for rank in (0, 1):
        errors = results[f"attention rank {rank}"].value["errors"]
        assert len(errors) == len(rank0 if rank == 0 else rank1)
        assert max(errors) <= tolerance, errors
    destinations = results["attention rank 1"].value["destinations"]
    if shared == "attention":  # FFN rank 1 got nothing for that layer and was not waited on
        assert [0] in destinations
    else:  # shared rows are split over every FFN rank
        assert all(d == [0, 1] for d in destinations)
    served = results["ffn rank 1"].value["served"] + results["ffn rank 0"].value["served"]
    assert {replica for replica, *_ in served} == {0, 1}


def test_a_replica_of_two_participants_is_served_as_one_work_item() -> None:
    window = layout(2, 2, per_dp=2)
    ffn0 = list(window.slot.topology.local_experts(0))
    jobs0 = [{"layer": layer, "tokens": 20} for layer in range(LAYERS)]
    jobs1 = [{"layer": layer, "tokens": 3, "experts": ffn0} for layer in range(LAYERS)]
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_linear,
            {"seed": 5, "layers": LAYERS, "jobs": jobs0},
        ),
        RankSpec(
            Role.ATTENTION,
            1,
            workers.attention_linear,
            {"seed": 5, "layers": LAYERS, "jobs": jobs1},
        ),
        *[
            RankSpec(Role.FFN, r, workers.ffn_linear, {"seed": 5, "layers": LAYERS})
            for r in range(2)
        ],
    ]
    results = launch(window, specs, timeout=120)
    for rank in (0, 1):
        assert max(results[f"attention rank {rank}"].value["errors"]) <= 1e-5
    for rank in (0, 1):
        served = results[f"ffn rank {rank}"].value["served"]
        assert len(served) == LAYERS
        assert all(parts == [0, 1] for *_, parts in served)


def _garbage_specs(attention_extra: dict[str, Any], ffn_extra: dict[str, Any]) -> list[RankSpec]:
    """One attention rank that writes garbage into a slot before its job, one FFN rank."""
    attention = {
        "seed": 1,
        "layers": LAYERS,
        "jobs": [{"layer": 0, "tokens": 8}],
        "garbage_first": True,
    }
    return [
        RankSpec(Role.ATTENTION, 0, workers.attention_linear, attention | attention_extra),
        RankSpec(Role.FFN, 0, workers.ffn_linear, {"seed": 1, "layers": LAYERS} | ffn_extra),
    ]


def test_garbage_in_a_slot_is_a_protocol_error_not_a_crash() -> None:
    window = layout(1, 1, experts=4, ring_depth=2)
    specs = _garbage_specs({}, {"tolerate_garbage": True})
    results = launch(window, specs, timeout=60)
    errors = results["ffn rank 0"].value["protocol_errors"]
    assert len(errors) == 1
    assert "slot from attention rank 0 (ring 1)" in errors[0]
    assert max(results["attention rank 0"].value["errors"]) <= 1e-5


def test_garbage_fails_the_run_fast_when_not_tolerated() -> None:
    window = layout(1, 1, experts=4, ring_depth=2)
    specs = _garbage_specs({"timeout": 30}, {})
    with pytest.raises(LaunchError) as caught:
        launch(window, specs, timeout=60)
    results = caught.value.results
    assert results["ffn rank 0"].error_type == "ProtocolError"
    # Stopped by the FFN rank's abort word, not by its own 30 s timeout (a PeerTimeout).
    assert results["attention rank 0"].error_type == "PeerAborted"
    assert "aborted" in (results["attention rank 0"].error or "")
    # The message says where each rank raised, so a failure is findable without the tracebacks.
    assert "raised at ffn.py:" in str(caught.value)


def test_killed_ffn_rank_fails_its_peers_within_the_timeout_and_leaks_nothing() -> None:
    window = layout(1, 2, experts=4, topk=2)
    before = set(leftover_segments())
    pids: dict[str, int] = {}
    specs = [
        RankSpec(Role.ATTENTION, 0, workers.attention_forever, {"timeout": 10.0}),
        RankSpec(Role.FFN, 0, workers.ffn_linear, {"seed": 0, "layers": 1}),
        RankSpec(Role.FFN, 1, workers.ffn_linear, {"seed": 0, "layers": 1, "die_after": 5}),
    ]
    with pytest.raises(LaunchError) as caught:
        launch(window, specs, timeout=60, on_start=pids.update)
    results = caught.value.results
    assert results["ffn rank 1"].error == "killed by SIGKILL"
    # Found dead by the liveness check, not by waiting out the 10 s timeout (a PeerTimeout).
    assert results["attention rank 0"].error_type == "PeerAborted"
    assert "ffn rank 1 (pid" in (results["attention rank 0"].error or "")
    assert results["ffn rank 0"].error_type == "PeerAborted"
    for pid in pids.values():  # every process is gone
        assert not _child_of_this_process(pid)  # reaped (a reused pid belongs to someone else)
    assert set(leftover_segments()) <= before


def test_a_rank_stopped_by_sigterm_is_named_as_such_and_first() -> None:
    """Its handler unwinds it (the transport closes, the abort word is set) and it reports
    the signal, not the SystemExit the handler raised; the launcher's message lists it
    before the peers that only saw it go (PeerAborted)."""
    window = layout(1, 2, experts=4, topk=2)
    before = set(leftover_segments())
    dying = {"seed": 0, "layers": 1, "die_after": 5, "die_by": signal.SIGTERM}
    specs = [
        RankSpec(Role.ATTENTION, 0, workers.attention_forever, {"timeout": 10.0}),
        RankSpec(Role.FFN, 0, workers.ffn_linear, {"seed": 0, "layers": 1}),
        RankSpec(Role.FFN, 1, workers.ffn_linear, dying),
    ]
    with pytest.raises(LaunchError) as caught:
        launch(window, specs, timeout=60)
    results = caught.value.results
    assert results["ffn rank 1"].error == "stopped by SIGTERM"
    assert results["ffn rank 1"].error_type == STOPPED_BY_SIGNAL
    assert results["ffn rank 1"].traceback is None
    assert results["attention rank 0"].error_type == "PeerAborted"
    message = str(caught.value)
    assert message.startswith("3 of 3 ranks failed: ffn rank 1: stopped by SIGTERM; "), message
    assert "SystemExit" not in message
    assert set(leftover_segments()) <= before


def test_the_message_orders_cause_before_consequence() -> None:
    def failed(name: str, error: str, kind: str | None) -> RankResult:
        return RankResult(name, False, error=error, error_type=kind)

    results = {
        "attention rank 0": failed(
            "attention rank 0", "PeerAborted: ffn rank 0 aborted", "PeerAborted"
        ),
        "attention rank 1": failed("attention rank 1", "did not stop within 10 s", None),
        "ffn rank 0": failed("ffn rank 0", "ValueError: bad", "ValueError"),
        "ffn rank 1": failed("ffn rank 1", "killed by SIGKILL", None),
        "ffn rank 2": RankResult("ffn rank 2", True, value=1),
    }
    order = [part.split(":")[0] for part in str(LaunchError(results)).split(": ", 1)[1].split("; ")]
    assert order == ["ffn rank 1", "ffn rank 0", "attention rank 0", "attention rank 1"]
    assert str(LaunchError(results)).startswith("4 of 5 ranks failed: ")


def _child_of_this_process(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(text[text.rindex(")") + 2 :].split()[1]) == os.getpid()


def test_mismatched_geometry_is_refused_naming_the_parameter() -> None:
    attention_window = layout(1, 1, experts=4, tokens=48)
    ffn_window = layout(1, 1, experts=4, tokens=64)
    # Each role gets its own geometry: the launcher passes the window per rank, so build
    # two launches' worth of specs by hand through one launch with a wrapper target.
    specs = [
        RankSpec(Role.ATTENTION, 0, workers.attention_linear, {"seed": 1, "layers": 1, "jobs": []}),
        RankSpec(Role.FFN, 0, workers.ffn_linear, {"seed": 1, "layers": 1}),
    ]
    with pytest.raises(LaunchError) as caught:
        launch(attention_window, specs, timeout=60, window_overrides={"ffn rank 0": ffn_window})
    messages = " ".join(r.error or "" for r in caught.value.results.values())
    assert (
        "max_num_batched_tokens is 48 here but 64 there" in messages
        or "max_num_batched_tokens is 64 here but 48 there" in messages
    )


def test_sequence_numbers_wrap_without_losing_or_confusing_a_message() -> None:
    """Both ranks start three messages before 2**31 - 1, so the ring slots' flags and the
    replies' ANSWER_SEQ cross the wrap to 1 mid-run, with two stages in flight."""
    window = layout(1, 1, experts=4, ring_depth=2)
    last = SEQ_LIMIT - 4  # the next three numbers are SEQ_LIMIT - 3 .. SEQ_LIMIT - 1
    jobs = [{"layer": layer % LAYERS, "tokens": 5 + layer} for layer in range(8)]
    specs = [
        RankSpec(
            Role.ATTENTION,
            0,
            workers.attention_linear,
            {"seed": 3, "layers": LAYERS, "jobs": jobs, "in_flight": 2, "last_seq": last},
        ),
        *ffn_specs(1, last_seq=last),
    ]
    results = launch(window, specs, timeout=60)
    attention = results["attention rank 0"].value
    assert len(attention["errors"]) == len(jobs)
    assert max(attention["errors"]) <= 1e-5
    # 8 dispatches and a shutdown from the attention rank, 8 replies from the FFN rank: each
    # counter wrapped once, skipping 0, and ended on a small number.
    assert attention["last_seq"] == 9 - 3
    assert results["ffn rank 0"].value["last_seq"] == 8 - 3
    assert len(results["ffn rank 0"].value["served"]) == len(jobs)
    # The reply flags in the attention window hold post-wrap values, never 0 after use.
    assert all(0 < f < 10 for f in attention["flags"][: window.ring_depth])
