"""The window endpoints at the edges of their contract, over the loopback transport.

Every refusal is checked word for word (a user reads these messages to know what to
change); crafted headers stand in for a buggy, stale or misdirected peer, one field at a
time, so each check of the receiving side is seen to fire on its own; and waits are seen
to honour the limit they were given, including while something arrives during them.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from afd_protocol import (
    ConnectorShutdown,
    Header,
    InvalidArgument,
    MessageKind,
    PeerTimeout,
    ProtocolError,
    Role,
    SlotLayout,
    Topology,
    decode_header,
    encode_header,
)
from afd_protocol.testing import LinearExperts
from afd_protocol.window import (
    Arrivals,
    LoopbackTransport,
    LoopbackWorld,
    WindowAttentionEndpoint,
    WindowFFNEndpoint,
    WindowOptions,
    abort_words,
    flag_words,
    slot_view,
)

HIDDEN = 8
FAST = WindowOptions(timeout=0.05)
BOUNDED = WindowOptions(timeout=0.05, num_layers=4, num_stages=2)


def world_of(
    a: int = 1,
    f: int = 1,
    experts: int = 6,
    topk: int = 2,
    ring_depth: int = 1,
    shared: str = "ffn",
    per_dp: int = 1,
    dtype: str = "float32",
) -> LoopbackWorld:
    topo = Topology(a, f, experts, attn_ranks_per_dp=per_dp)
    layout = SlotLayout(topo, HIDDEN, 16, topk, dtype=dtype, shared_placement=shared)
    return LoopbackWorld(layout.window(ring_depth=ring_depth))


def inputs(
    ids: Sequence[Sequence[int]], seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and weights for the routing ``ids`` (chosen by hand, so counts are known)."""
    generator = torch.Generator().manual_seed(seed)
    topk_ids = torch.tensor(ids, dtype=torch.long)
    x = torch.randn(len(ids), HIDDEN, generator=generator).to(dtype)
    w = torch.rand(topk_ids.shape, generator=generator)
    return x, topk_ids, w


# Three tokens routed to the experts of FFN rank 0 only (it holds 0, 1, 2 of six):
# expert counts (3, 2, 1), so a reordering of them keeps their sum.
ROUTING = [[0, 1], [0, 2], [0, 1]]


def plant(
    world: LoopbackWorld,
    receiver: tuple[Role, int],
    sender: int,
    ring: int,
    header: Header,
    flag: int | None = None,
) -> None:
    """Write ``header`` into ``receiver``'s slot from ``sender`` and raise its flag, as a
    peer would (``flag``: the value published, the header's SEQ unless given)."""
    window = world.windows[receiver]
    words = encode_header(header)
    slot_view(window, world.window, sender, ring).header[: words.numel()] = words
    index = world.window.flag_index(sender, ring)
    flag_words(window, world.window)[index] = header.seq if flag is None else flag


def sent_header(world: LoopbackWorld, ffn: int, src: int, ring: int = 0) -> Header:
    """The dispatch header attention rank ``src`` wrote into FFN rank ``ffn``'s window."""
    window = world.windows[(Role.FFN, ffn)]
    return decode_header(slot_view(window, world.window, src, ring).header)


def reply_to(sent: Header, seq: int = 7, **changes: object) -> Header:
    """A well-formed reply to ``sent`` from FFN rank 0, with ``changes`` applied."""
    reply = Header(
        MessageKind.REPLY,
        src_rank=0,
        layer=sent.layer,
        stage=sent.stage,
        num_tokens=sent.num_tokens,
        routed_rows=sent.routed_rows,
        shared_rows=sent.shared_rows,
        seq=seq,
        answer_seq=sent.seq,
        expert_counts=sent.expert_counts,
    )
    return dataclasses.replace(reply, **changes)  # type: ignore[arg-type]


def exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def assert_reference(
    out: torch.Tensor,
    experts: LinearExperts,
    layer: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
) -> None:
    """``out`` equals the float64 reference (shared experts on the FFN side, as here)."""
    torch.testing.assert_close(
        out.double(), experts.reference(layer, x, ids, w, True), rtol=1e-5, atol=1e-4
    )


# ---- what dispatch refuses ---------------------------------------------------------------


def test_every_dispatch_refusal_says_what_to_change_and_keeps_the_ring() -> None:
    world = world_of()
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(BOUNDED)
    x, ids, w = inputs(ROUTING)
    meta = torch.device("meta")
    refusals = [
        (
            lambda: attention.dispatch(0, x.double(), ids, w),
            "hidden_states are torch.float64 but the window carries torch.float32; cast "
            "them or configure dtype=float64",
        ),
        (
            lambda: attention.dispatch(-1, x, ids, w),
            "layer_idx and stage must be >= 0, got -1, 0",
        ),
        (
            lambda: attention.dispatch(0, x, ids, w, stage=-2),
            "layer_idx and stage must be >= 0, got 0, -2",
        ),
        (lambda: attention.dispatch(4, x, ids, w), "4 is outside [0, num_layers=4)"),
        (lambda: attention.dispatch(0, x, ids, w, stage=2), "2 is outside [0, num_stages=2)"),
        (
            lambda: attention.dispatch(0, x.to(meta), ids, w),
            "hidden_states is on meta but this transport's window is on cpu; move the "
            "inputs there first",
        ),
        (
            lambda: attention.dispatch(0, x, ids.to(meta), w),
            "topk_ids is on meta but this transport's window is on cpu; move the inputs "
            "there first",
        ),
        (
            lambda: attention.dispatch(0, x, ids, w.to(meta)),
            "topk_weights is on meta but this transport's window is on cpu; move the "
            "inputs there first",
        ),
        (
            lambda: attention.dispatch(0, x.clone().requires_grad_(), ids, w),
            "hidden_states requires grad; dispatch under torch.inference_mode() or "
            "torch.no_grad() (the wire carries values, not autograd history)",
        ),
    ]
    for call, message in refusals:
        with pytest.raises(InvalidArgument, match=exactly(message)):
            call()
    # Nothing was taken: the last layer and stage the options allow go out on ring 0.
    handle = attention.dispatch(3, x, ids, w, stage=1)
    assert (handle.layer, handle.stage, handle.ring) == (3, 1, 0)
    assert attention.in_flight == 1


def test_dispatch_after_shutdown_and_kernel_options_without_kernels_are_refused() -> None:
    world = world_of()
    connection = world.connection(Role.ATTENTION, 0)
    with pytest.raises(
        InvalidArgument,
        match=exactly(
            "combine='fused', device_pack=None need device kernels, which this "
            "LoopbackTransport does not offer; use the defaults (combine='auto', "
            "device_pack=None)"
        ),
    ):
        connection.attention_endpoint(WindowOptions(combine="fused"))
    attention = connection.attention_endpoint(FAST)
    attention.announce_shutdown()
    with pytest.raises(ConnectorShutdown, match=exactly("dispatch after announce_shutdown()")):
        attention.dispatch(0, *inputs(ROUTING))


class FailingPublish(LoopbackTransport):
    """A transport whose ``fail_at``-th publish (counting from 1) raises, like a dead link."""

    def __init__(self, world: LoopbackWorld, fail_at: int) -> None:
        super().__init__(world, Role.ATTENTION, 0)
        self.fail_at = fail_at
        self.publishes = 0

    def publish(self, peer: int, flag_index: int, value: int) -> None:
        self.publishes += 1
        if self.publishes == self.fail_at:
            raise OSError("link down")
        super().publish(peer, flag_index, value)


def test_a_send_that_fails_before_any_publish_returns_its_ring_first_in_line() -> None:
    world = world_of(f=2, ring_depth=2)
    transport = FailingPublish(world, fail_at=1)
    attention = WindowAttentionEndpoint(transport, FAST)
    x, ids, w = inputs(ROUTING)
    with pytest.raises(OSError, match="link down"):
        attention.dispatch(0, x, ids, w)
    assert attention.in_flight == 0
    handle = attention.dispatch(0, x, ids, w)
    assert handle.ring == 0  # the ring the failed dispatch took, not the next one
    aborts = [abort_words(world.windows[(Role.FFN, r)], world.window) for r in range(2)]
    assert [int(a[0]) for a in aborts] == [0, 0]  # no peer saw anything: nobody is told


def test_a_send_that_fails_after_a_publish_aborts_every_peer() -> None:
    world = world_of(f=2, ring_depth=2)
    attention = WindowAttentionEndpoint(FailingPublish(world, fail_at=2), FAST)
    x, ids, w = inputs([[0, 3], [1, 4], [2, 5]])  # rows for both FFN ranks
    with pytest.raises(OSError, match="link down"):
        attention.dispatch(0, x, ids, w)
    aborts = [abort_words(world.windows[(Role.FFN, r)], world.window) for r in range(2)]
    assert [int(a[0]) for a in aborts] == [1, 1]


# ---- replies the attention side refuses -------------------------------------------------


def dispatched(
    options: WindowOptions = BOUNDED,
) -> tuple[LoopbackWorld, WindowAttentionEndpoint, WindowFFNEndpoint, Header, object]:
    """Two FFN ranks; attention rank 0 sends layer 1 (routed rows to FFN rank 0 only,
    shared rows to both), and FFN rank 0 takes it."""
    world = world_of(f=2)
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(options)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(options)
    handle = attention.dispatch(1, *inputs(ROUTING))
    assert handle.ffn_ranks == (0, 1)
    ffn.next_work_item()
    return world, attention, ffn, sent_header(world, 0, 0), handle


@pytest.mark.parametrize(
    ("changes", "flag", "problems"),
    [
        ({"src_rank": 1}, None, "SRC_RANK=1"),
        ({}, 8, "SEQ=7 but the flag says 8"),
        ({"answer_seq": 5}, None, "ANSWER_SEQ=5 but this dispatch was seq 1"),
        ({"layer": 2}, None, "LAYER=2 STAGE=0"),
        ({"stage": 1}, None, "LAYER=1 STAGE=1"),
        ({"expert_counts": (1, 2, 3)}, None, "EXPERT_COUNTS differ from what was sent"),
        ({"shared_rows": 1}, None, "SHARED_ROWS=1"),
        (
            {"kind": MessageKind.DISPATCH, "answer_seq": 0},
            None,
            "KIND=DISPATCH; ANSWER_SEQ=0 but this dispatch was seq 1",
        ),
    ],
)
def test_a_misdirected_reply_is_refused_naming_each_wrong_field(
    changes: dict[str, object], flag: int | None, problems: str
) -> None:
    world, attention, _ffn, sent, handle = dispatched()
    assert (sent.expert_counts, sent.shared_rows) == ((3, 2, 1), 2)
    plant(world, (Role.ATTENTION, 0), 0, 0, reply_to(sent, **changes), flag)
    with pytest.raises(
        ProtocolError,
        match=exactly(f"stale or misdirected reply from FFN rank 0 (ring 0, layer 1): {problems}"),
    ):
        attention.combine(handle)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"layer": 9}, "LAYER=9, expected [0, 4)"),
        ({"stage": 5}, "STAGE=5, expected [0, 2)"),
        ({"src_rank": 2}, "SRC_RANK=2, expected [0, 2)"),
        ({"expert_counts": (3, 3)}, "NUM_COUNTS=2, expected 3"),
    ],
)
def test_a_reply_outside_what_the_receiver_knows_fails_to_decode(
    changes: dict[str, object], complaint: str
) -> None:
    world, attention, _ffn, sent, handle = dispatched()
    if "expert_counts" in changes:
        changes = {**changes, "routed_rows": 6, "num_tokens": 3}
    plant(world, (Role.ATTENTION, 0), 0, 0, reply_to(sent, **changes))
    with pytest.raises(
        ProtocolError,
        match=exactly(f"reply from FFN rank 0 (ring 0): bad slot header: {complaint}"),
    ):
        attention.combine(handle)  # type: ignore[arg-type]


# ---- dispatches the FFN side refuses ----------------------------------------------------


def dispatch_header(src: int, seq: int, **changes: object) -> Header:
    """A well-formed dispatch of ``ROUTING`` from ``src``, with ``changes`` applied."""
    header = Header(
        MessageKind.DISPATCH,
        src_rank=src,
        layer=1,
        stage=0,
        num_tokens=3,
        routed_rows=6,
        shared_rows=0,
        seq=seq,
        expert_counts=(3, 2, 1),
    )
    return dataclasses.replace(header, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "flag", "complaint"),
    [
        (
            {"kind": MessageKind.REPLY, "answer_seq": 1},
            None,
            " is inconsistent: KIND=REPLY, SRC_RANK=0, SEQ=3 (flag 3)",
        ),
        ({"src_rank": 1}, None, " is inconsistent: KIND=DISPATCH, SRC_RANK=1, SEQ=3 (flag 3)"),
        ({}, 4, " is inconsistent: KIND=DISPATCH, SRC_RANK=0, SEQ=3 (flag 4)"),
        ({"layer": 4}, None, ": bad slot header: LAYER=4, expected [0, 4)"),
        ({"stage": 2}, None, ": bad slot header: STAGE=2, expected [0, 2)"),
        (
            {"expert_counts": (3, 3), "routed_rows": 6},
            None,
            ": bad slot header: NUM_COUNTS=2, expected 3",
        ),
    ],
)
def test_a_dispatch_that_contradicts_its_slot_is_refused(
    changes: dict[str, object], flag: int | None, complaint: str
) -> None:
    world = world_of(a=2, f=2)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(BOUNDED)
    plant(world, (Role.FFN, 0), 0, 0, dispatch_header(0, 3, **changes), flag)
    with pytest.raises(
        ProtocolError, match=exactly(f"FFN rank 0: slot from attention rank 0 (ring 0){complaint}")
    ):
        ffn.next_work_item()


def test_every_bad_slot_of_one_wait_is_reported_together() -> None:
    world = world_of(a=2, f=2)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(BOUNDED)
    for src in range(2):
        plant(world, (Role.FFN, 0), src, 0, dispatch_header(src, 3), flag=5)
    with pytest.raises(
        ProtocolError,
        match=exactly(
            "FFN rank 0: slot from attention rank 0 (ring 0) is inconsistent: KIND=DISPATCH, "
            "SRC_RANK=0, SEQ=3 (flag 5); FFN rank 0: slot from attention rank 1 (ring 0) is "
            "inconsistent: KIND=DISPATCH, SRC_RANK=1, SEQ=3 (flag 5)"
        ),
    ):
        ffn.next_work_item()


def test_a_layer_published_twice_before_its_answer_is_refused() -> None:
    again = "FFN rank 0: attention rank 0 published layer 1 stage 0 again before it was answered"
    # Waiting for the other participant of its replica: the first part is still pending.
    world = world_of(a=2, f=2, per_dp=2, ring_depth=2)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(BOUNDED)
    plant(world, (Role.FFN, 0), 0, 0, dispatch_header(0, 1))
    with pytest.raises(PeerTimeout):
        ffn.next_work_item(timeout=0.01)
    plant(world, (Role.FFN, 0), 0, 1, dispatch_header(0, 2))
    with pytest.raises(ProtocolError, match=exactly(again)):
        ffn.next_work_item()
    # Taken and not yet answered.
    world = world_of(f=2, ring_depth=2)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(BOUNDED)
    plant(world, (Role.FFN, 0), 0, 0, dispatch_header(0, 1))
    ffn.next_work_item()
    plant(world, (Role.FFN, 0), 0, 1, dispatch_header(0, 2))
    with pytest.raises(ProtocolError, match=exactly(again)):
        ffn.next_work_item()


def test_a_work_item_part_carries_what_its_header_announced() -> None:
    world = world_of(f=2)
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(BOUNDED)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(BOUNDED)
    x, ids, w = inputs(ROUTING)
    attention.dispatch(3, x, ids, w, stage=1)
    item = ffn.next_work_item()
    assert (item.replica, item.layer, item.stage) == (0, 3, 1)
    (part,) = item.parts
    assert (part.src_rank, part.num_tokens) == (0, 3)
    assert part.group_list.dtype == torch.int64
    assert part.group_list.tolist() == [3, 2, 1]
    assert part.layer_index.dtype == torch.int32
    assert part.layer_index.tolist() == [3]
    # Rows grouped by local expert: expert 0 gets tokens 0, 1, 2; expert 1 tokens 0, 2; ...
    torch.testing.assert_close(part.routed_rows, x[[0, 1, 2, 0, 2, 1]])
    torch.testing.assert_close(part.shared_rows, x[[0, 2]])  # round robin: its shared tokens


# ---- what reply refuses, and replies to several participants ----------------------------


def test_reply_refuses_missing_or_malformed_shared_outputs() -> None:
    world = world_of()
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(FAST)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(FAST)
    attention.dispatch(0, *inputs(ROUTING))
    item = ffn.next_work_item()
    assert (item.num_routed_rows, item.num_shared_rows) == (6, 3)
    routed = torch.zeros(6, HIDDEN)
    for shared, message in [
        (None, "shared_out has shape None, expected [3, 8]"),
        (torch.zeros(1, HIDDEN), "shared_out has shape (1, 8), expected [3, 8]"),
        (
            torch.zeros(3, HIDDEN, dtype=torch.float64),
            "shared_out is torch.float64 but the window carries torch.float32; cast it first",
        ),
    ]:
        with pytest.raises(InvalidArgument, match=exactly(message)):
            ffn.reply(item, routed, shared)
    ffn.reply(item, routed, torch.zeros(3, HIDDEN))  # the item was still in service


def test_one_reply_is_split_back_over_the_participants_of_a_replica() -> None:
    world = world_of(a=3, f=2, per_dp=3)
    attention = [world.connection(Role.ATTENTION, r).attention_endpoint(FAST) for r in range(3)]
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(2)]
    experts = LinearExperts(2, 6, HIDDEN, seed=3)
    jobs = [
        inputs([[0, 4], [1, 2], [5, 0], [2, 3]], seed=1),
        inputs([[2, 1], [3, 0]], seed=2),
        inputs([[4, 5], [0, 3], [1, 4]], seed=3),
    ]
    handles = [ep.dispatch(1, *job) for ep, job in zip(attention, jobs, strict=True)]
    for ffn in ffns:
        item = ffn.next_work_item()
        assert [p.src_rank for p in item.parts] == [0, 1, 2]
        assert all(p.routed_rows.shape[0] and p.shared_rows.shape[0] for p in item.parts)
        experts.reply_to(ffn, item)
    for ep, handle, (x, ids, w) in zip(attention, handles, jobs, strict=True):
        assert_reference(ep.combine(handle), experts, 1, x, ids, w)


def test_a_bfloat16_window_combines_to_bfloat16() -> None:
    world = world_of(dtype="bfloat16")
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(FAST)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(FAST)
    experts = LinearExperts(1, 6, HIDDEN, seed=4)
    x, ids, w = inputs(ROUTING, dtype=torch.bfloat16)
    handle = attention.dispatch(0, x, ids, w)
    experts.reply_to(ffn, ffn.next_work_item())
    out = attention.combine(handle)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.double(), experts.reference(0, x, ids, w, True), rtol=3e-2, atol=3e-2
    )


def test_an_ffn_rank_closed_with_items_taken_and_parts_waiting_aborts() -> None:
    world = world_of(a=2)
    attention = [world.connection(Role.ATTENTION, r).attention_endpoint(FAST) for r in range(2)]
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(FAST)
    for ep in attention:
        ep.dispatch(0, *inputs(ROUTING))
    ffn.next_work_item()  # one replica's item in service, the other's part received
    ffn.close()
    aborts = [abort_words(world.windows[(Role.ATTENTION, r)], world.window) for r in range(2)]
    assert [int(a[0]) for a in aborts] == [1, 1]


def test_ffn_shutdown_is_announced_once_for_the_transport() -> None:
    world = world_of()
    connection = world.connection(Role.FFN, 0)
    transport = connection.transport
    ffn = connection.ffn_endpoint(FAST)
    ffn.announce_shutdown()
    assert transport.shutdown_announced is True
    assert transport.sequence.last == 1
    ffn.close()
    connection.ffn_endpoint(FAST).announce_shutdown()  # a later endpoint does not repeat it
    assert transport.sequence.last == 1


# ---- waits ------------------------------------------------------------------------------


class RecordingTransport(LoopbackTransport):
    """Records the timeout of every wait and, when nothing is there, fails at once."""

    def __init__(self, world: LoopbackWorld, role: Role, rank: int) -> None:
        super().__init__(world, role, rank)
        self.timeouts: list[float] = []

    def wait_any(
        self,
        flag_indices: Sequence[int],
        last_seen: Sequence[int],
        timeout: float,
        peers: Sequence[int],
    ) -> Arrivals:
        self.timeouts.append(timeout)
        return super().wait_any(flag_indices, last_seen, 0.0, peers)


def test_waits_are_given_the_time_left_of_their_own_limit() -> None:
    world = world_of(f=2, shared="attention")
    attention_transport = RecordingTransport(world, Role.ATTENTION, 0)
    attention = WindowAttentionEndpoint(attention_transport, FAST)
    ffn_transport = RecordingTransport(world, Role.FFN, 0)
    ffn = WindowFFNEndpoint(ffn_transport, FAST)
    handle = attention.dispatch(0, *inputs(ROUTING))
    with pytest.raises(PeerTimeout, match=r"FFN ranks \[0\] did not reply to layer 0 stage 0 "):
        attention.combine(handle, timeout=30.0)
    with pytest.raises(PeerTimeout, match=r"within 0\.05 s; they may be dead or overloaded"):
        attention.combine(handle)  # the endpoint's own timeout
    assert 29.0 < attention_transport.timeouts[0] <= 30.0
    assert 0.0 < attention_transport.timeouts[1] <= 0.05
    ffn.next_work_item()
    with pytest.raises(
        PeerTimeout, match=exactly("FFN rank 0: no work item became ready within 30 s")
    ):
        ffn.next_work_item(timeout=30.0)
    assert 29.0 < ffn_transport.timeouts[-1] <= 30.0


def test_a_reply_from_a_later_rank_is_taken_while_an_earlier_one_is_missing() -> None:
    world = world_of(f=2)
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(FAST)
    ffns = [world.connection(Role.FFN, r).ffn_endpoint(FAST) for r in range(2)]
    experts = LinearExperts(1, 6, HIDDEN, seed=5)
    x, ids, w = inputs([[0, 3], [1, 4], [2, 5]])
    handle = attention.dispatch(0, x, ids, w)
    experts.reply_to(ffns[1], ffns[1].next_work_item())
    with pytest.raises(PeerTimeout, match=r"FFN ranks \[0\] did not reply"):
        attention.combine(handle, timeout=0.02)
    experts.reply_to(ffns[0], ffns[0].next_work_item())
    assert_reference(attention.combine(handle), experts, 0, x, ids, w)


def test_the_previous_reply_in_a_ring_is_not_taken_for_the_next_one() -> None:
    world = world_of()
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(FAST)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(FAST)
    experts = LinearExperts(2, 6, HIDDEN, seed=7)
    for layer in range(2):
        x, ids, w = inputs(ROUTING, seed=layer)
        handle = attention.dispatch(layer, x, ids, w)
        assert handle.ring == 0
        # Layer 0's reply is still in ring 0 when layer 1 waits: it is old, not an arrival.
        with pytest.raises(PeerTimeout, match=r"FFN ranks \[0\] did not reply"):
            attention.combine(handle, timeout=0.01)
        experts.reply_to(ffn, ffn.next_work_item())
        assert_reference(attention.combine(handle), experts, layer, x, ids, w)


def test_work_and_replies_that_arrive_during_a_wait_end_it() -> None:
    world = world_of()
    attention = world.connection(Role.ATTENTION, 0).attention_endpoint(FAST)
    ffn = world.connection(Role.FFN, 0).ffn_endpoint(FAST)
    experts = LinearExperts(1, 6, HIDDEN, seed=6)
    x, ids, w = inputs(ROUTING)
    handles = []
    waiting = threading.Event()

    def dispatch_once_waited_on() -> None:
        waiting.wait(10.0)
        time.sleep(0.02)  # let next_work_item enter its wait
        handles.append(attention.dispatch(0, x, ids, w))

    sender = threading.Thread(target=dispatch_once_waited_on)
    sender.start()
    waiting.set()
    item = ffn.next_work_item(timeout=10.0)
    sender.join(10.0)
    (handle,) = handles

    def reply_soon() -> None:
        time.sleep(0.02)  # let combine enter its wait
        experts.reply_to(ffn, item)

    replier = threading.Thread(target=reply_soon)
    replier.start()
    out = attention.combine(handle, timeout=10.0)
    replier.join(10.0)
    assert_reference(out, experts, 0, x, ids, w)


def test_a_rank_connection_reports_what_it_holds_and_refuses_a_rank_outside_the_topology() -> None:
    from afd_protocol import RankConnection, TopologyError

    layout = SlotLayout(Topology(2, 1, 4), 8, 4, 2)
    held = RankConnection(layout, "ffn", 0, torch.device("cpu"))
    assert (held.role, held.rank, held.layout, held.device) == (
        Role.FFN,
        0,
        layout,
        torch.device("cpu"),
    )
    assert not hasattr(held, "attention_endpoint")  # the base makes none: a subclass does
    with pytest.raises(TopologyError, match="ffn rank 1"):
        RankConnection(layout, Role.FFN, 1, torch.device("cpu"))
