"""The emulated compact CAM operators against references written here, one rank at a time
from one thread (every window in this process): what a receive hands out (rows, order,
batch information, counts), chunking, quantisation, the combine, and every protocol rule
whose violation would hang or corrupt on the NPU."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from afd_protocol import CapacityError, InvalidArgument, PeerTimeout, ProtocolError
from afd_transport_cam.emulator import ops
from afd_transport_cam.emulator.world import LocalCamWorld, register_world, unregister_world
from afd_transport_cam.geometry import CamGeometry, receive_capacity

_names = itertools.count()


@dataclass
class Cam:
    """One emulated communicator and the operators' common arguments."""

    geo: CamGeometry
    group: str

    @property
    def placeholder(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.float16)

    def dispatch(
        self, rank: int, x: torch.Tensor, ids: torch.Tensor, layer: int = 0
    ) -> torch.Tensor:
        g = self.geo
        return ops.afd_async_dispatch_send(
            x, ids.to(torch.int32), self.placeholder, 0, g.max_seq_len, x.shape[0],
            g.hidden_size, g.top_k, g.num_ffn, g.num_attention, g.experts_per_rank, rank,
            g.world_size, layer, g.tp_size, int(g.dynamic_quant), self.group,
        )  # fmt: skip

    def receive(self, ffn: int) -> list[torch.Tensor]:
        g = self.geo
        return ops.afd_async_dispatch_recv(
            torch.zeros(1, dtype=g.dtype), self.placeholder, 0, g.max_seq_len, g.hidden_size,
            g.top_k, g.num_ffn, g.num_attention, g.experts_per_rank, g.num_attention + ffn,
            g.world_size, g.tp_size, int(g.dynamic_quant), self.group,
        )  # fmt: skip

    def reply(self, ffn: int, rows: torch.Tensor, batch_info: torch.Tensor) -> torch.Tensor:
        g = self.geo
        return ops.afd_async_combine_send(
            rows, self.placeholder, batch_info, 0, g.max_seq_len, g.hidden_size, g.top_k,
            g.num_ffn, g.num_attention, g.experts_per_rank, g.num_attention + ffn,
            g.world_size, g.tp_size, self.group,
        )  # fmt: skip

    def combine(self, rank: int, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        g = self.geo
        return ops.afd_async_combine_recv(
            torch.zeros(1, dtype=g.dtype), ids.to(torch.int32), weights.float(),
            self.placeholder, 0, ids.shape[0], g.hidden_size, g.top_k, g.num_ffn,
            g.num_attention, g.experts_per_rank, rank, g.world_size, self.group,
        )  # fmt: skip


@pytest.fixture
def make_cam() -> Iterator[object]:
    groups: list[str] = []

    def make(
        a: int = 4,
        m: int = 2,
        r: int = 3,
        k: int = 2,
        h: int = 8,
        seq: int = 16,
        tp: int = 2,
        quant: bool = False,
        dtype: torch.dtype = torch.float32,
        timeout: float = 0.2,
    ) -> Cam:
        geo = CamGeometry(a, m, r, k, h, seq, tp, quant, dtype)
        group = f"cam-test-{next(_names)}"
        register_world(group, LocalCamWorld(geo.world_size, geo.window_bytes, timeout))
        groups.append(group)
        return Cam(geo, group)

    yield make
    for group in groups:
        unregister_world(group)
    ops._PENDING.clear()


@pytest.fixture(autouse=True)
def small_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCH_SIZE_FACTOR", "0.001")  # 262 rows: cheap receive buffers


def routing(tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])


def expected_rows(
    cam: Cam, ffn: int, group: int, batches: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, list[int]]:
    """The receive of FFN rank ``ffn`` for replica ``group``, by a plain loop: for each local
    expert, each member in order, its tokens (one row per choice) in token order."""
    g = cam.geo
    rows, counts = [], []
    for local in range(g.experts_per_rank):
        expert = ffn * g.experts_per_rank + local
        for t in range(g.tp_size):
            x, ids = batches[group * g.tp_size + t]
            picks = [
                tok for tok in range(ids.shape[0]) for j in range(g.top_k) if ids[tok, j] == expert
            ]
            rows += [x[tok] for tok in picks]
            counts.append(len(picks))
    return torch.stack(rows) if rows else torch.zeros(0, g.hidden_size), counts


def scale_by_expert(cam: Cam, ffn: int, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A stand-in expert: local expert ``j`` of FFN rank ``m`` multiplies by ``m * R + j + 1``."""
    factors = torch.arange(cam.geo.experts_per_rank) + ffn * cam.geo.experts_per_rank + 1
    per_row = torch.repeat_interleave(factors, counts)
    return rows[: per_row.numel()].float() * per_row[:, None]


def serve(cam: Cam, ffn: int) -> list[torch.Tensor]:
    payload, scales, info, counts = cam.receive(ffn)
    rows = payload[: int(counts.sum())]
    if cam.geo.dynamic_quant:
        rows = rows.float() * scales[: rows.shape[0], None]
    out = scale_by_expert(cam, ffn, rows, counts).to(cam.geo.dtype)
    cam.reply(
        ffn, out if out.shape[0] else torch.zeros(1, cam.geo.hidden_size, dtype=cam.geo.dtype), info
    )
    return [payload, scales, info, counts]


def reference(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_k w * (expert id + 1) * x, in float64."""
    factor = (weights.double() * (ids.double() + 1)).sum(dim=1)
    return factor[:, None] * x.double()


def test_a_receive_hands_out_each_replica_expert_major_with_its_batch_info(make_cam) -> None:  # type: ignore[no-untyped-def]
    cam = make_cam()  # 4 attention ranks in 2 replicas of 2, 2 FFN ranks x 3 experts, top-2
    g = cam.geo
    batches = {}
    for rank, tokens in enumerate((5, 8, 3, 1)):
        ids = routing(tokens, g.num_experts, g.top_k, seed=rank)
        x = torch.randn(tokens, g.hidden_size, generator=torch.Generator().manual_seed(rank))
        batches[rank] = (x, ids)
        assert cam.dispatch(rank, x, ids, layer=7 + rank).dtype == torch.int8
    for ffn in range(g.num_ffn):
        for group in range(g.num_groups):  # round robin from replica 0
            payload, scales, info, counts = cam.receive(ffn)
            want, per_member = expected_rows(cam, ffn, group, batches)
            n = want.shape[0]
            assert int(counts.sum()) == n
            torch.testing.assert_close(payload[:n], want, rtol=0, atol=0)
            assert torch.isnan(payload[n : n + 4]).all()  # poisoned past the valid rows
            assert scales.shape == (1,)
            # [pairs of the whole replica here, first rank, layer, start, end | Q per member |
            #  pairs per member and local expert]
            members = [batches[group * 2 + t][1] for t in range(2)]
            owner = [torch.div(ids, 3, rounding_mode="floor") for ids in members]
            pairs_here = sum(int((o == ffn).sum()) for o in owner)
            offsets = [int((o < ffn).sum()) for o in owner]  # pairs sent to lower FFN ranks
            member_counts = [[int((ids == ffn * 3 + j).sum()) for j in range(3)] for ids in members]
            assert info.dtype == torch.int64
            assert info.tolist() == [
                pairs_here,
                group * 2,
                7 + group * 2,
                0,
                2,
                *offsets,
                *(c for row in member_counts for c in row),
            ]
            assert counts.tolist() == [sum(member_counts[t][j] for t in range(2)) for j in range(3)]
            assert per_member == [member_counts[t][j] for j in range(3) for t in range(2)]
            cam.reply(ffn, scale_by_expert(cam, ffn, payload[:n], counts), info)
    for rank, (x, ids) in batches.items():
        w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(10 + rank))
        out = cam.combine(rank, ids, w)
        torch.testing.assert_close(out.double(), reference(ids, w, x), rtol=1e-5, atol=1e-5)


def run_layer(cam: Cam, tokens: list[int], seed: int = 0) -> dict[int, tuple[torch.Tensor, ...]]:
    """Every attention rank dispatches; returns its (x, ids, weights)."""
    g = cam.geo
    batches = {}
    for rank, n in enumerate(tokens):
        gen = torch.Generator().manual_seed(seed + rank)
        ids = routing(n, g.num_experts, g.top_k, seed=seed + rank)
        x = torch.randn(n, g.hidden_size, generator=gen).to(g.dtype)
        batches[rank] = (x, ids, torch.rand(n, g.top_k, generator=gen))
        cam.dispatch(rank, x, ids)
    return batches


def test_quantised_dispatch_stays_within_half_a_step_per_token(make_cam) -> None:  # type: ignore[no-untyped-def]
    cam = make_cam(quant=True, dtype=torch.bfloat16)
    batches = run_layer(cam, [6, 4, 5, 3], seed=3)
    for ffn in range(2):
        for _ in range(2):
            payload, scales, _, counts = serve(cam, ffn)
            assert payload.dtype == torch.int8
            assert scales.dtype == torch.float32
            assert scales.shape == (receive_capacity(),)
            assert int(payload[: int(counts.sum())].abs().max()) <= 127
    for rank, (x, ids, w) in batches.items():
        out = cam.combine(rank, ids, w)
        assert out.dtype == torch.bfloat16
        # Each row is off by at most amax / 254 per element before the experts; the
        # experts scale by (id + 1) and the combine weights; bf16 rounding on top.
        step = x.float().abs().amax(dim=1, keepdim=True).double() / 254
        bound = (w.double() * (ids.double() + 1)).sum(dim=1, keepdim=True) * step
        error = (out.double() - reference(ids, w, x.float())).abs()
        assert torch.all(error <= bound + 2e-2 * reference(ids, w, x.float()).abs() + 1e-6)


def test_a_replica_larger_than_the_capacity_is_served_in_whole_expert_chunks(
    make_cam,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    cam = make_cam(a=2, m=1, r=4, k=2, seq=64, tp=2)
    # Every token picks experts 0 and 1, or 2 and 3: 10 rows per member, 20 per expert.
    g = cam.geo
    ids = torch.tensor([[0, 1]] * 10 + [[2, 3]] * 10)
    batches = {}
    for rank in range(2):
        x = torch.randn(20, g.hidden_size, generator=torch.Generator().manual_seed(rank))
        batches[rank] = (x, ids, torch.rand(20, 2))
        cam.dispatch(rank, x, ids)
    monkeypatch.setenv("BATCH_SIZE_FACTOR", str(45.5 / 262144))  # 45 rows: two experts of 20
    home_status = ops.home(cam_world(cam).window(0), cam.geo).status
    served = []
    for _ in range(2):
        _payload, _, info, counts = serve(cam, 0)
        served.append((info[3].item(), info[4].item(), counts.tolist()))
        if len(served) == 1:
            assert int(home_status[0]) == 0  # no status before the last chunk
    assert served == [(0, 1, [20, 20, 0, 0]), (2, 3, [0, 0, 20, 20])]
    for rank, (x, ids_, w) in batches.items():
        out = cam.combine(rank, ids_, w)
        torch.testing.assert_close(out.double(), reference(ids_, w, x), rtol=1e-5, atol=1e-5)
    # One expert alone larger than the capacity: refused, naming the fix.
    monkeypatch.setenv("BATCH_SIZE_FACTOR", str(15.5 / 262144))
    for rank in range(2):
        cam.dispatch(rank, batches[rank][0], ids)
    with pytest.raises(
        CapacityError,
        match="local expert 0 of attention replica 0 has 20 rows, more than the receive capacity",
    ):
        cam.receive(0)


def cam_world(cam: Cam):  # type: ignore[no-untyped-def]
    from afd_transport_cam.emulator.world import world_for

    return world_for(cam.group)


def test_an_ffn_rank_with_no_rows_is_still_served_and_answered(make_cam) -> None:  # type: ignore[no-untyped-def]
    cam = make_cam(a=2, m=2, r=2, k=2, tp=1)
    x = torch.randn(3, 8)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])  # all on FFN rank 0
    w = torch.rand(3, 2)
    cam.dispatch(0, x, ids)
    _payload, _, info, counts = cam.receive(1)
    assert counts.tolist() == [0, 0]
    assert info.tolist() == [0, 0, 0, 0, 1, 6, 0, 0]  # Q = 6: after FFN rank 0's six pairs
    with pytest.raises(PeerTimeout, match=r"replies from every FFN rank.*status words \[0, 0\]"):
        cam.combine(0, ids, w)  # neither FFN rank answered yet
    cam.reply(1, torch.zeros(1, 8), info)  # the zero-row answer
    serve(cam, 0)
    out = cam.combine(0, ids, w)
    torch.testing.assert_close(out.double(), reference(ids, w, x), rtol=1e-5, atol=1e-5)


def test_a_flooding_replica_does_not_starve_the_other(make_cam) -> None:  # type: ignore[no-untyped-def]
    cam = make_cam(a=2, m=1, r=2, k=1, tp=1)
    x, ids, w = torch.randn(2, 8), torch.tensor([[0], [1]]), torch.ones(2, 1)
    cam.dispatch(1, x, ids)  # replica 1 is ready once
    cam.dispatch(0, x, ids)
    order = []
    for _ in range(3):
        replica = int(serve(cam, 0)[2][1])
        order.append(replica)
        cam.combine(replica, ids, w)
        if replica == 0:
            cam.dispatch(0, x, ids)  # replica 0 is ready again at once, every time
    # The scan continues after the replica just served, so replica 1 is not starved.
    assert order == [0, 1, 0]


def test_protocol_violations_are_errors_not_hangs_or_garbage(make_cam) -> None:  # type: ignore[no-untyped-def]
    cam = make_cam(a=1, m=1, r=2, k=1, tp=1, timeout=0.05)
    x, ids, w = torch.randn(2, 8), torch.tensor([[0], [1]]), torch.ones(2, 1)
    with pytest.raises(ProtocolError, match="combine_recv without a dispatch in flight"):
        cam.combine(0, ids, w)
    with pytest.raises(PeerTimeout, match=r"ready words per attention rank \[0\]"):
        cam.receive(0)  # nothing was sent: the NPU would spin forever
    cam.dispatch(0, x, ids)
    with pytest.raises(ProtocolError, match="one dispatch in flight per attention rank"):
        cam.dispatch(0, x, ids)
    payload, _, info, _counts = cam.receive(0)
    with pytest.raises(ProtocolError, match="received again before combine_send"):
        cam.receive(0)
    with pytest.raises(InvalidArgument, match="expand_x is int8"):
        cam.reply(0, payload.to(torch.int8), info)
    bad = info.clone()
    bad[2] += 1
    with pytest.raises(ProtocolError, match="not the one its latest dispatch_recv returned"):
        cam.reply(0, payload, bad)
    with pytest.raises(InvalidArgument, match=r"expand_x must be \[>= 2, 8\]"):
        cam.reply(0, payload[:1], info)
    cam.reply(0, payload[:2], info)
    with pytest.raises(ProtocolError, match="already answered"):
        cam.reply(0, payload[:2], info)
    with pytest.raises(ProtocolError, match="expert_ids are not the ones dispatched"):
        cam.combine(0, ids.flip(0), w)
    out = cam.combine(0, ids, w)
    assert out.shape == (2, 8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k": 7}, r"top_k=7 must be in \[1, moe_rank_num \* route_expert_num_per_moe = 6\]"),
        ({"tp": 3}, "tp_size=3 must divide attn_rank_num=4"),
        ({"seq": 1}, r"max_seq_len=1 must be in \[tp_size=2, 262144\]"),
        ({"dtype": torch.int32}, "activations must be one of"),
    ],
)
def test_the_host_checks_refuse_what_the_tiling_refuses(change: dict, message: str) -> None:  # type: ignore[type-arg]
    args = {"a": 4, "m": 2, "r": 3, "k": 2, "h": 8, "seq": 16, "tp": 2, "dtype": torch.float32}
    args.update(change)
    with pytest.raises(InvalidArgument, match=message):
        CamGeometry(
            args["a"], args["m"], args["r"], args["k"], args["h"], args["seq"], args["tp"],
            False, args["dtype"],
        )  # fmt: skip


def test_bad_calls_name_the_argument(make_cam, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    cam = make_cam()
    x, ids = torch.randn(2, 8), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(
        InvalidArgument, match=r"batch_size=9 must be in \[1, max_seq_len / tp_size = 8\]"
    ):
        cam.dispatch(0, torch.randn(9, 8), routing(9, 6, 2, 0))
    with pytest.raises(InvalidArgument, match=r"expert_ids holds 6, outside \[0"):
        cam.dispatch(0, x, torch.tensor([[0, 6], [1, 2]]))
    with pytest.raises(InvalidArgument, match="expert_ids must be int32"):
        ops.afd_async_dispatch_send(
            x, ids, cam.placeholder, 0, 16, 2, 8, 2, 2, 4, 3, 0, 6, 0, 2, 0, cam.group
        )
    with pytest.raises(InvalidArgument, match="world_size=7 but attn_rank_num"):
        ops.afd_async_dispatch_send(
            x, ids.int(), cam.placeholder, 0, 16, 2, 8, 2, 2, 4, 3, 0, 7, 0, 2, 0, cam.group
        )
    with pytest.raises(InvalidArgument, match="no emulated CAM communicator named 'nope'"):
        ops.afd_async_dispatch_send(
            x, ids.int(), cam.placeholder, 0, 16, 2, 8, 2, 2, 4, 3, 0, 6, 0, 2, 0, "nope"
        )
    monkeypatch.setenv("BATCH_SIZE_FACTOR", "2")
    with pytest.raises(InvalidArgument, match=r"BATCH_SIZE_FACTOR=2 is outside \(0, 1\]"):
        receive_capacity()


def test_the_operators_are_registered_under_the_real_names(make_cam) -> None:  # type: ignore[no-untyped-def]
    from afd_transport_cam.emulator.library import register_emulated_ops

    register_emulated_ops()
    register_emulated_ops()  # idempotent
    cam = make_cam(a=1, m=1, r=2, k=1, tp=1)
    g = cam.geo
    x, ids, w = (
        torch.randn(3, 8),
        torch.tensor([[1], [0], [1]], dtype=torch.int32),
        torch.rand(3, 1),
    )
    ns = torch.ops.afd_ascend
    ns.afd_async_dispatch_send(
        x, ids, cam.placeholder, 0, 16, 3, 8, 1, 1, 1, 2, 0, 2, 4, 1, 0, cam.group
    )
    payload, _scales, info, counts = ns.afd_async_dispatch_recv(
        torch.zeros(1), cam.placeholder, 0, 16, 8, 1, 1, 1, 2, 1, 2, 1, 0, cam.group
    )
    assert int(info[2]) == 4  # the layer, delivered in a tensor
    out = scale_by_expert(cam, 0, payload[: int(counts.sum())], counts)
    ns.afd_async_combine_send(out, cam.placeholder, info, 0, 16, 8, 1, 1, 1, 2, 1, 2, 1, cam.group)
    got = ns.afd_async_combine_recv(
        torch.zeros(1), ids, w, cam.placeholder, 0, 3, 8, 1, 1, 1, 2, 0, 2, cam.group
    )
    torch.testing.assert_close(got.double(), reference(ids, w, x), rtol=1e-5, atol=1e-5)
    assert g.world_size == 2


def test_a_replica_is_ready_only_when_every_member_dispatched(make_cam) -> None:  # type: ignore[no-untyped-def]
    cam = make_cam(a=2, m=1, r=2, k=1, tp=2, timeout=0.05)
    x, ids = torch.randn(2, 8), torch.tensor([[0], [1]])
    cam.dispatch(0, x, ids, layer=3)
    with pytest.raises(PeerTimeout, match=r"ready words per attention rank \[3, 0\]"):
        cam.receive(0)  # member 1 has not dispatched: the replica is not ready
    cam.dispatch(1, 2 * x, ids, layer=3)
    payload, _, info, counts = cam.receive(0)
    assert info.tolist()[:5] == [4, 0, 3, 0, 1]
    # Expert-major, then member: expert 0 gets member 0's token 0, then member 1's.
    torch.testing.assert_close(payload[:4], torch.stack([x[0], 2 * x[0], x[1], 2 * x[1]]))
    assert counts.tolist() == [2, 2]
