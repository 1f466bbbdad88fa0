"""The afd endpoints over CAM's compact routed-only operators.

CAM's operators own the whole exchange and its layout, so this backend implements the
endpoint protocols of :mod:`afd_protocol.core.endpoints` directly, one operator per call:

* attention: ``dispatch`` -> ``afd_async_dispatch_send``, ``combine`` ->
  ``afd_async_combine_recv`` (the weighted sum in fp32, routed experts only: the caller
  computes the shared experts, ``shared_placement`` is ``attention``);
* FFN: ``next_work_item`` -> ``afd_async_dispatch_recv`` (one part holding the whole
  replica's rows, grouped by local expert; a replica larger than the receive capacity
  comes as several work items of the same layer, whole experts each), ``reply`` ->
  ``afd_async_combine_send``.

What CAM imposes, and how the endpoints present it:

* **one dispatch in flight per attention rank**: a second ``dispatch`` before ``combine``
  raises :class:`~afd_protocol.RingExhausted` before anything is written, so an engine
  overlaps stages by alternating them (send s0, attention s1, combine s0, send s1, ...);
  the stage is not carried (work items report stage 0);
* **no empty batch**: a dispatch of 0 tokens sends one zero token (its combine returns
  ``[0, H]``), and a work item with no rows is answered with one zero row;
* **every FFN rank answers every dispatch**, so every FFN rank must keep serving;
* **no shutdown message**: ``announce_shutdown`` on an attention rank dispatches one zero
  token at layer :data:`SHUTDOWN_LAYER`, which the FFN endpoint answers and counts instead
  of handing it out; once every replica announced, ``next_work_item`` raises
  :class:`~afd_protocol.ConnectorShutdown` (on the FFN side it is a no-op: attention
  ranks never wait for it);
* the experts must be split evenly and contiguously (FFN rank ``m`` owns
  ``[m * R, (m + 1) * R)``), and int8 dispatch (``dynamic_quant``) is dequantised for the
  FFN on receipt (a W8A8 expert path could consume the int8 rows and scales instead).

:func:`cam_geometry` derives the operators' arguments from afd's :class:`SlotLayout`
(``max_seq_len`` = the per-rank token capacity x ``attn_ranks_per_dp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from afd_protocol import (
    AFDError,
    ConnectorShutdown,
    EndpointOptions,
    InvalidArgument,
    RankConnection,
    RingExhausted,
    Role,
    SharedPlacement,
    SlotLayout,
    TopologyError,
    WorkItem,
    WorkItemKey,
    WorkItemPart,
    check_dispatch_inputs,
    torch_dtype,
)
from afd_transport_cam.binding import EMULATED, CamOperators
from afd_transport_cam.emulator.world import spin_timeout
from afd_transport_cam.geometry import CamGeometry
from afd_transport_cam.quant import dequantize

SHUTDOWN_LAYER = 1 << 62
"""The layer index of the dispatch that announces an attention rank's shutdown."""


def cam_geometry(layout: SlotLayout, dynamic_quant: bool = False) -> CamGeometry:
    """The CAM operators' arguments for an afd deployment (or why it cannot run on CAM)."""
    topo = layout.topology
    if layout.shared_placement is not SharedPlacement.ATTENTION:
        raise TopologyError(
            "CAM's compact operators carry routed experts only: use shared_placement="
            "'attention' (the attention ranks compute the shared experts)"
        )
    placement = topo.expert_placement
    per_rank = placement.experts_per_rank[0]
    even = all(
        placement.owner[e] == e // per_rank and placement.local_id[e] == e % per_rank
        for e in range(placement.num_experts)
    ) and all(n == per_rank for n in placement.experts_per_rank)
    if not even:
        raise TopologyError(
            f"CAM's operators place expert e on FFN rank e // R: the {placement.num_experts} "
            f"experts must split evenly and contiguously over the {topo.num_ffn_ranks} FFN "
            f"ranks (got {placement.experts_per_rank} per rank)"
        )
    return CamGeometry(
        num_attention=topo.num_attention_ranks,
        num_ffn=topo.num_ffn_ranks,
        experts_per_rank=per_rank,
        top_k=layout.topk,
        hidden_size=layout.hidden_size,
        max_seq_len=layout.token_cap * topo.attn_ranks_per_dp,
        tp_size=topo.attn_ranks_per_dp,
        dynamic_quant=dynamic_quant,
        dtype=torch_dtype(layout.dtype),
    )


class _CamEndpoint:
    """What both roles share: the operators' arguments and the lifecycle."""

    def __init__(
        self,
        layout: SlotLayout,
        geo: CamGeometry,
        group_name: str,
        rank: int,
        options: EndpointOptions | None = None,
        operators: CamOperators = EMULATED,
        device: torch.device | None = None,
    ) -> None:
        self._layout = layout
        self._geo = geo
        self._group = group_name
        self._rank = rank
        self.options = options or EndpointOptions()
        self._ops = operators
        self._device = device or torch.device(operators.device_type)
        self._closed = False
        self._shutdown_announced = False
        self._anchor = torch.zeros(1, dtype=geo.dtype, device=self._device)
        self._comm_args = torch.zeros(1, dtype=torch.float16, device=self._device)
        self._setup()

    def _setup(self) -> None:
        """Check the rank and set up the role's own state."""
        raise NotImplementedError

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def dtype(self) -> torch.dtype:
        return self._geo.dtype

    @property
    def shared_placement(self) -> SharedPlacement:
        return SharedPlacement.ATTENTION

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"this CAM {type(self).__name__} is closed")

    def _operator_args(self) -> tuple[int, int, int, int, int]:
        """``hidden_size, top_k, moe_rank_num, attn_rank_num, route_expert_num_per_moe``."""
        g = self._geo
        return g.hidden_size, g.top_k, g.num_ffn, g.num_attention, g.experts_per_rank

    def close(self) -> None:
        self._closed = True


@dataclass(eq=False)
class CamDispatch:
    """The handle of one CAM dispatch."""

    layer: int
    stage: int
    ffn_ranks: tuple[int, ...]
    num_tokens: int
    expert_ids: torch.Tensor
    weights: torch.Tensor


class CamAttentionEndpoint(_CamEndpoint):
    """Dispatch and combine for one attention rank over the CAM operators."""

    def _setup(self) -> None:
        self._geo.check_attention_rank(self._rank)
        self._pending: CamDispatch | None = None

    @property
    def in_flight(self) -> int:
        return 0 if self._pending is None else 1

    def dispatch(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        stage: int = 0,
    ) -> CamDispatch:
        """See :meth:`afd_protocol.AttentionEndpoint.dispatch` (and the module docstring)."""
        self._check_open()
        if self._shutdown_announced:
            raise ConnectorShutdown("dispatch after announce_shutdown()")
        num_tokens = self._check_inputs(layer_idx, stage, hidden_states, topk_ids, topk_weights)
        if self._pending is not None:
            raise RingExhausted(
                f"attention rank {self._rank} already has layer {self._pending.layer} stage "
                f"{self._pending.stage} in flight: CAM keeps one dispatch in flight per "
                f"attention rank, so combine it first"
            )
        ids = topk_ids.to(torch.int32)
        weights = topk_weights.float()
        if num_tokens == 0:  # CAM refuses an empty batch: one zero token stands in
            hidden_states, ids = self._zero_token()
            weights = torch.zeros(1, self._geo.top_k, device=self._device)
        self._send(hidden_states, ids, layer_idx)
        self._pending = CamDispatch(
            layer=layer_idx,
            stage=stage,
            ffn_ranks=tuple(range(self._geo.num_ffn)),
            num_tokens=num_tokens,
            expert_ids=ids,
            weights=weights,
        )
        return self._pending

    def _zero_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One zero token routed to the first ``top_k`` experts: CAM's stand-in batch."""
        x = torch.zeros(1, self._geo.hidden_size, dtype=self.dtype, device=self._device)
        ids = torch.arange(self._geo.top_k, dtype=torch.int32, device=self._device)
        return x, ids.view(1, -1)

    def _send(self, x: torch.Tensor, ids: torch.Tensor, layer_index: int) -> None:
        g = self._geo
        hidden, top_k, moe, attn, per_moe = self._operator_args()
        self._ops.dispatch_send(
            x, ids, self._comm_args, 0, g.max_seq_len, x.shape[0], hidden, top_k, moe, attn,
            per_moe, self._rank, g.world_size, layer_index, g.tp_size, int(g.dynamic_quant),
            self._group,
        )  # fmt: skip

    def _check_inputs(
        self,
        layer_idx: int,
        stage: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> int:
        """afd's dispatch contract, the batch capacity, and CAM's reserved layer index."""
        args = (layer_idx, stage, hidden_states, topk_ids, topk_weights)
        check_dispatch_inputs(self._layout, self.options, self._device, "CAM connection", *args)
        num_tokens = hidden_states.shape[0]
        self._layout.check_capacity(num_tokens)
        if layer_idx >= SHUTDOWN_LAYER:
            raise InvalidArgument(
                f"layer_idx {layer_idx} is at or above {SHUTDOWN_LAYER}, the layer index CAM's "
                f"endpoints reserve for announcing shutdown"
            )
        return num_tokens

    def combine(self, handle: object, timeout: float | None = None) -> torch.Tensor:
        """See :meth:`afd_protocol.AttentionEndpoint.combine`: routed experts only."""
        self._check_open()
        if handle is not self._pending or self._pending is None:
            raise InvalidArgument(
                "this handle is not in flight on this endpoint (already combined, or "
                "dispatched elsewhere)"
            )
        pending = self._pending
        g = self._geo
        hidden, top_k, moe, attn, per_moe = self._operator_args()
        with spin_timeout(self.options.timeout if timeout is None else timeout):
            out: torch.Tensor = self._ops.combine_recv(
                self._anchor, pending.expert_ids, pending.weights, self._comm_args, 0,
                pending.expert_ids.shape[0], hidden, top_k, moe, attn, per_moe, self._rank,
                g.world_size, self._group,
            )  # fmt: skip
        self._pending = None
        return out[: pending.num_tokens]

    def announce_shutdown(self) -> None:
        """Tell every FFN rank that this rank sends no more work (module docstring)."""
        if self._shutdown_announced:
            return
        self._check_open()
        if self._pending is not None:
            raise AFDError("announce_shutdown() with a dispatch in flight; combine it first")
        self._send(*self._zero_token(), SHUTDOWN_LAYER)
        self._shutdown_announced = True

    def abort(self) -> None:
        """Nothing to tell through the operators; the connection's abort reaches the peers."""


@dataclass
class _Received:
    item: WorkItem
    batch_info: torch.Tensor
    rows: int


class CamFFNEndpoint(_CamEndpoint):
    """Work-item intake and replies for one FFN rank over the CAM operators."""

    def _setup(self) -> None:
        if not 0 <= self._rank < self._geo.num_ffn:
            raise InvalidArgument(f"FFN rank {self._rank} is outside [0, {self._geo.num_ffn})")
        self._in_service: _Received | None = None
        self._finished: set[int] = set()

    @property
    def local_experts(self) -> tuple[int, ...]:
        r = self._geo.experts_per_rank
        return tuple(range(self._rank * r, (self._rank + 1) * r))

    def next_work_item(self, timeout: float | None = None) -> WorkItem:
        """See :meth:`afd_protocol.FFNEndpoint.next_work_item` (one part per item)."""
        self._check_open()
        if self._in_service is not None:
            raise InvalidArgument(
                "reply to the work item in service first: CAM answers every receive before "
                "the next one"
            )
        g = self._geo
        hidden, top_k, moe, attn, per_moe = self._operator_args()
        with spin_timeout(self.options.timeout if timeout is None else timeout):
            while True:
                if len(self._finished) == g.num_groups:
                    raise ConnectorShutdown(
                        f"FFN rank {self._rank}: every attention replica shut down"
                    )
                payload, scales, info, counts = self._ops.dispatch_recv(
                    self._anchor, self._comm_args, 0, g.max_seq_len, hidden, top_k, moe, attn,
                    per_moe, g.num_attention + self._rank, g.world_size, g.tp_size,
                    int(g.dynamic_quant), self._group,
                )  # fmt: skip
                replica = int(info[1]) // g.tp_size
                if int(info[2]) != SHUTDOWN_LAYER:
                    break
                self._finished.add(replica)
                rows = max(1, int(counts.sum()))  # the announcing token's rows, as zeros
                self._answer(torch.zeros(rows, hidden, dtype=self.dtype, device=self._device), info)
        rows = int(counts.sum())
        routed = payload[:rows]
        if g.dynamic_quant:
            routed = dequantize(routed, scales[:rows], self.dtype)
        part = WorkItemPart(
            src_rank=int(info[1]),
            num_tokens=rows,
            routed_rows=routed,
            shared_rows=torch.zeros(0, hidden, dtype=self.dtype, device=self._device),
            group_list=counts,
            layer_index=info[2:3],
        )
        item = WorkItem(WorkItemKey(replica, int(info[2]), 0), (part,))
        self._in_service = _Received(item, info, rows)
        return item

    def reply(
        self, item: WorkItem, routed_out: torch.Tensor, shared_out: torch.Tensor | None = None
    ) -> None:
        """See :meth:`afd_protocol.FFNEndpoint.reply`; ``shared_out`` must be empty."""
        self._check_open()
        received = self._in_service
        if received is None or received.item is not item:
            raise InvalidArgument(
                "reply to a work item that is not in service; each item is answered once"
            )
        hidden = self._geo.hidden_size
        if tuple(routed_out.shape) != (received.rows, hidden):
            raise InvalidArgument(
                f"routed_out has shape {tuple(routed_out.shape)}, expected "
                f"[{received.rows}, {hidden}]"
            )
        if shared_out is not None and shared_out.numel():
            raise InvalidArgument("CAM carries no shared-expert rows: pass shared_out=None")
        if routed_out.dtype != self.dtype:
            raise InvalidArgument(
                f"routed_out is {routed_out.dtype} but the CAM geometry carries {self.dtype}"
            )
        if not received.rows:  # CAM needs a row to send, even for an empty item
            routed_out = torch.zeros(1, hidden, dtype=self.dtype, device=self._device)
        self._answer(routed_out, received.batch_info)
        self._in_service = None

    def _answer(self, rows: torch.Tensor, batch_info: torch.Tensor) -> None:
        g = self._geo
        hidden, top_k, moe, attn, per_moe = self._operator_args()
        self._ops.combine_send(
            rows, self._comm_args, batch_info, 0, g.max_seq_len, hidden, top_k, moe, attn, per_moe,
            g.num_attention + self._rank, g.world_size, g.tp_size, self._group,
        )  # fmt: skip

    def announce_shutdown(self) -> None:
        """A no-op: attention ranks never wait for an FFN rank's shutdown in CAM."""
        self._shutdown_announced = True

    def abort(self) -> None:
        """Nothing to tell through the operators; the connection's abort reaches the peers."""


class CamLink(Protocol):
    """What a connection releases: the communicator's windows (the emulator's) or nothing."""

    def abort(self) -> None: ...

    def close(self) -> None: ...


class CamConnection(RankConnection):
    """One rank's link to an emulated (or real) CAM communicator; makes its endpoint."""

    def __init__(
        self,
        layout: SlotLayout,
        role: Role | str,
        rank: int,
        group_name: str,
        *,
        dynamic_quant: bool = False,
        link: CamLink | None = None,
        operators: CamOperators = EMULATED,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(layout, role, rank, device or torch.device(operators.device_type))
        self._group = group_name
        self._geo = cam_geometry(layout, dynamic_quant)
        self._link = link
        self._ops = operators
        self._closed = False

    @property
    def geometry(self) -> CamGeometry:
        return self._geo

    def attention_endpoint(self, options: EndpointOptions | None = None) -> CamAttentionEndpoint:
        if self._role is not Role.ATTENTION:
            raise InvalidArgument(f"this is {self._role.value} rank {self._rank}'s connection")
        return CamAttentionEndpoint(
            self._layout, self._geo, self._group, self._rank, options, self._ops, self._device
        )

    def ffn_endpoint(self, options: EndpointOptions | None = None) -> CamFFNEndpoint:
        if self._role is not Role.FFN:
            raise InvalidArgument(f"this is {self._role.value} rank {self._rank}'s connection")
        return CamFFNEndpoint(
            self._layout, self._geo, self._group, self._rank, options, self._ops, self._device
        )

    def abort(self) -> None:
        """Tell every peer that this rank failed (their spinning operators stop)."""
        if self._link is not None and not self._closed:
            self._link.abort()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()
