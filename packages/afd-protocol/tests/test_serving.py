"""The one FFN serving loop, driven by a scripted endpoint: what it does on each outcome of
``next_work_item``, what it replies, and what it records."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from afd_protocol import (
    ConnectorShutdown,
    InvalidArgument,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    ServeStats,
    SharedPlacement,
    WorkItem,
    WorkItemKey,
    WorkItemPart,
    serve,
)

HIDDEN = 4


def item(layer: int, rows: int, src: int = 0) -> WorkItem:
    part = WorkItemPart(
        src_rank=src,
        num_tokens=rows,
        routed_rows=torch.arange(rows * HIDDEN, dtype=torch.bfloat16).view(rows, HIDDEN),
        shared_rows=torch.empty(0, HIDDEN, dtype=torch.bfloat16),
        group_list=torch.tensor([rows]),
        layer_index=torch.tensor([layer], dtype=torch.int32),
    )
    return WorkItem(WorkItemKey(replica=src, layer=layer, stage=0), (part,))


class ScriptedEndpoint:
    """An FFNEndpoint whose next_work_item returns or raises from a script, in order."""

    rank = 0
    dtype = torch.bfloat16
    shared_placement = SharedPlacement.ATTENTION
    local_experts = (0,)

    def __init__(self, script: list[WorkItem | Exception]) -> None:
        self._script: Iterator[WorkItem | Exception] = iter(script)
        self.replies: list[tuple[WorkItem, torch.Tensor, torch.Tensor | None]] = []
        self.timeouts: list[float | None] = []

    def next_work_item(self, timeout: float | None = None) -> WorkItem:
        self.timeouts.append(timeout)
        step = next(self._script)
        if isinstance(step, Exception):
            raise step
        return step

    def reply(self, item: WorkItem, routed: torch.Tensor, shared: torch.Tensor | None) -> None:
        self.replies.append((item, routed, shared))

    def announce_shutdown(self) -> None: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


def doubled(work: WorkItem) -> tuple[torch.Tensor, None]:
    rows = torch.cat([p.routed_rows for p in work.parts])
    return rows.float() * 2, None  # float32: the loop casts to the wire's dtype


def test_serves_until_shutdown_casting_replies_and_recording_every_item() -> None:
    first, second = item(3, 2), item(1, 5, src=1)
    endpoint = ScriptedEndpoint([first, second, ConnectorShutdown("done")])
    seen: list[int] = []
    stats = serve(endpoint, doubled, timeout=2.5, after_reply=lambda w: seen.append(w.layer))
    assert [r[0] for r in endpoint.replies] == [first, second]
    for work, routed, shared in endpoint.replies:
        assert routed.dtype == torch.bfloat16
        assert torch.equal(routed, work.parts[0].routed_rows * 2)
        assert shared is None
    assert endpoint.timeouts == [2.5, 2.5, 2.5]
    assert seen == [3, 1]
    assert stats.served == [(0, 3, 0), (1, 1, 0)]
    assert stats.routed_rows == 7
    assert [r.src_ranks for r in stats.items] == [(0,), (1,)]
    assert all(r.taken <= r.computed <= r.replied for r in stats.items)
    assert stats.busy_s >= 0


def test_idle_timeouts_raise_or_are_waited_out() -> None:
    with pytest.raises(PeerTimeout):
        serve(ScriptedEndpoint([PeerTimeout("idle")]), doubled)
    endpoint = ScriptedEndpoint(
        [PeerTimeout("idle"), item(0, 1), PeerTimeout("idle"), ConnectorShutdown()]
    )
    stats = serve(endpoint, doubled, while_idle="wait")
    assert stats.served == [(0, 0, 0)]


def test_a_failed_peer_always_ends_the_loop() -> None:
    with pytest.raises(PeerAborted):
        serve(
            ScriptedEndpoint([item(0, 1), PeerAborted("attention rank 0 aborted")]),
            doubled,
            while_idle="wait",
            on_protocol_error="skip",
        )


def test_malformed_messages_raise_or_are_skipped_and_recorded() -> None:
    with pytest.raises(ProtocolError, match="bad magic"):
        serve(ScriptedEndpoint([ProtocolError("bad magic")]), doubled)
    endpoint = ScriptedEndpoint([ProtocolError("bad magic"), item(2, 1), ConnectorShutdown()])
    stats = serve(endpoint, doubled, on_protocol_error="skip")
    assert stats.protocol_errors == ["bad magic"]
    assert stats.served == [(0, 2, 0)]


def test_max_items_returns_early_and_given_stats_are_filled_live() -> None:
    endpoint = ScriptedEndpoint([item(0, 1), item(1, 2, src=1), item(2, 1), ConnectorShutdown()])
    stats = ServeStats()
    seen: list[list[int]] = []
    returned = serve(
        endpoint,
        doubled,
        max_items=2,
        stats=stats,
        after_reply=lambda w: seen.append(stats.per_replica(3)),
    )
    assert returned is stats
    assert stats.served == [(0, 0, 0), (1, 1, 0)]
    assert seen == [[1, 0, 0], [1, 1, 0]]  # recorded before after_reply runs
    assert endpoint.timeouts == [None, None]  # the third item was not taken
    # A second call records into the same stats; an error keeps what was served.
    with pytest.raises(PeerTimeout):
        serve(ScriptedEndpoint([item(0, 1), PeerTimeout("idle")]), doubled, stats=stats)
    assert stats.per_replica() == [2, 1]
    assert stats.per_replica(4) == [2, 1, 0, 0]
    assert serve(ScriptedEndpoint([]), doubled, max_items=0).items == []


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="while_idle"):
        serve(ScriptedEndpoint([]), doubled, while_idle="sleep")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="max_items"):
        serve(ScriptedEndpoint([]), doubled, max_items=-1)
