"""The seam every backend plugs into: the attention and FFN endpoint protocols.

An engine talks to AFD through two small interfaces and nothing else:

* :class:`AttentionEndpoint` on an attention rank: ``dispatch`` one MoE layer's tokens
  to the FFN ranks (returns at once with an opaque handle), then ``combine`` the handle
  into the layer's MoE output;
* :class:`FFNEndpoint` on an FFN rank: ``next_work_item`` takes whichever (replica,
  layer, stage) is ready, ``reply`` sends the expert outputs back.

A :class:`Connection` is one rank's open link to the opposite role (a transport after
its start-up rendezvous) and makes that rank's endpoint with immutable
:class:`EndpointOptions`. Implementations choose how bytes move: the window endpoints of
:mod:`afd_protocol.window` (host shared memory, NVSHMEM) write into peer-mapped windows;
an operator backend (Ascend CAM) calls operators that own the whole exchange and its
layout, and implements these protocols directly.

Shapes use ``T`` for the tokens of one dispatch, ``H`` for the hidden size, ``k`` for
the router's top-k and ``E_local`` for the experts of one FFN rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from afd_protocol.core.errors import InvalidArgument
from afd_protocol.core.layout import SharedPlacement, SlotLayout
from afd_protocol.core.plan import check_topk, check_topk_ids
from afd_protocol.core.tensors import torch_dtype
from afd_protocol.core.topology import Role
from afd_protocol.core.workitem import WorkItem


@dataclass(frozen=True)
class EndpointOptions:
    """What every endpoint is configured with, fixed at construction.

    Backends extend this with their own fields (a subclass, still frozen); an endpoint
    never changes its options after it was made.
    """

    timeout: float = 30.0
    """Seconds a wait (for a reply, or for the next work item) may take before
    :class:`~afd_protocol.core.errors.PeerTimeout`; a dead peer is reported sooner."""
    num_layers: int | None = None
    """Model layers; a header naming a layer at or beyond it is rejected (None: unchecked)."""
    num_stages: int | None = None
    """Stages in flight per replica; a header naming a stage beyond it is rejected."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {self.timeout}")
        for name in ("num_layers", "num_stages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgument(f"{name} must be >= 1 or None, got {value}")


@runtime_checkable
class DispatchHandle(Protocol):
    """What ``dispatch`` returns: opaque, except for what it dispatched and to whom."""

    @property
    def layer(self) -> int: ...

    @property
    def stage(self) -> int: ...

    @property
    def ffn_ranks(self) -> tuple[int, ...]:
        """The FFN ranks this dispatch went to, whose replies ``combine`` waits for."""


class AttentionEndpoint(Protocol):
    """Dispatch and combine for one attention rank.

    One dispatch per (layer, stage) may be in flight at a time for each stage; several
    stages may be. Dispatch and combine of one endpoint are called from one thread and,
    on an accelerator, issue their work on the current stream.
    """

    @property
    def rank(self) -> int:
        """This attention rank (role rank, 0-based)."""

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype of the rows on the wire (the dtype ``hidden_states`` must have)."""

    @property
    def shared_placement(self) -> SharedPlacement:
        """Where shared experts run; with ``attention`` the caller computes them itself."""

    @property
    def in_flight(self) -> int:
        """Dispatches not yet combined."""

    def dispatch(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        stage: int = 0,
    ) -> DispatchHandle:
        """Send one layer's tokens to the FFN ranks that own their experts; return at once.

        * ``hidden_states``: ``[T, H]``, :attr:`dtype`, on this endpoint's device, no grad;
        * ``topk_ids``: ``[T, k]``, an integer dtype (int32 or int64), global routed expert
          ids in ``[0, num_experts)``, same device;
        * ``topk_weights``: ``[T, k]``, a floating dtype (fp32 recommended), same device.
          They never travel: they stay here and weight the replies in :meth:`combine`.

        Raises :class:`~afd_protocol.core.errors.InvalidArgument` for a wrong shape, dtype,
        device or grad, :class:`~afd_protocol.core.errors.CapacityError` when the batch does
        not fit, :class:`~afd_protocol.core.errors.RingExhausted` when too many dispatches
        are in flight -- each before anything is written -- and
        :class:`~afd_protocol.core.errors.ConnectorShutdown` after :meth:`announce_shutdown`.
        """

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        """Wait for the replies to ``handle`` and return ``sum_j w[t, j] * expert_j(x[t])``.

        Returns ``[T, H]`` in :attr:`dtype` on this endpoint's device, accumulated in fp32
        (plus the shared experts' output when they run on the FFN side). ``timeout``
        overrides the options' for this call. After a
        :class:`~afd_protocol.core.errors.PeerTimeout` the same handle may be combined
        again; a handle combined once cannot be combined twice.
        """

    def announce_shutdown(self) -> None:
        """Tell every FFN rank that this rank sends no more work (idempotent)."""

    def abort(self) -> None:
        """Tell every peer that this rank failed, so their waits end at once."""

    def close(self) -> None:
        """Release this endpoint; the connection stays open (idempotent, never raises)."""


class FFNEndpoint(Protocol):
    """Work-item intake and replies for one FFN rank."""

    @property
    def rank(self) -> int:
        """This FFN rank (role rank, 0-based)."""

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype of the rows on the wire (what ``reply`` expects)."""

    @property
    def shared_placement(self) -> SharedPlacement:
        """Where shared experts run; with ``ffn`` work items carry shared rows."""

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Global ids of this rank's routed experts, by local id."""

    def next_work_item(self, timeout: float | None = None) -> WorkItem:
        """The next ready work item (rows as zero-copy views where they landed).

        Raises :class:`~afd_protocol.core.errors.ConnectorShutdown` once every attention
        rank announced shutdown and nothing is left,
        :class:`~afd_protocol.core.errors.PeerTimeout` when nothing became ready in time,
        :class:`~afd_protocol.core.errors.PeerAborted` when an attention rank failed, and
        :class:`~afd_protocol.core.errors.ProtocolError` for a malformed message (which is
        skipped: the endpoint stays usable).
        """

    def reply(
        self,
        item: WorkItem,
        routed_out: torch.Tensor,
        shared_out: torch.Tensor | None = None,
    ) -> None:
        """Send ``item``'s outputs back; the item's row views are invalid afterwards.

        * ``routed_out``: ``[item.num_routed_rows, H]`` in :attr:`dtype`: one output row per
          routed row, parts concatenated in ``item.parts`` order, unweighted (the
          attention side applies the top-k weights);
        * ``shared_out``: ``[item.num_shared_rows, H]`` likewise, or None when that is 0.
        """

    def announce_shutdown(self) -> None:
        """Tell every attention rank that this rank serves no more work (idempotent)."""

    def abort(self) -> None:
        """Tell every peer that this rank failed, so their waits end at once."""

    def close(self) -> None:
        """Release this endpoint; the connection stays open (idempotent, never raises)."""


def check_dispatch_inputs(
    layout: SlotLayout,
    options: EndpointOptions,
    device: torch.device,
    carrier: str,
    layer_idx: int,
    stage: int,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    """Raise :class:`InvalidArgument` unless ``dispatch``'s inputs meet the contract of
    :meth:`AttentionEndpoint.dispatch` for ``layout`` and ``options`` (``carrier`` names what
    carries the rows in the messages, e.g. "window"). Every endpoint calls this first, so the
    same mistake gets the same message whatever the backend."""
    hidden = layout.hidden_size
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise InvalidArgument(
            f"hidden_states must be [num_tokens, {hidden}], got {tuple(hidden_states.shape)}"
        )
    dtype = torch_dtype(layout.dtype)
    if hidden_states.dtype != dtype:
        raise InvalidArgument(
            f"hidden_states are {hidden_states.dtype} but the {carrier} carries {dtype}; "
            f"cast them or configure dtype={str(hidden_states.dtype).removeprefix('torch.')}"
        )
    check_topk_ids(topk_ids)
    if (
        tuple(topk_weights.shape) != tuple(topk_ids.shape)
        or topk_ids.shape[:1] != hidden_states.shape[:1]
    ):
        raise InvalidArgument(
            f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)} and "
            f"hidden_states {tuple(hidden_states.shape)} must agree on [num_tokens, topk]"
        )
    check_topk(topk_ids.shape[1], layout)
    if not topk_weights.dtype.is_floating_point:
        raise InvalidArgument(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if layer_idx < 0 or stage < 0:
        raise InvalidArgument(f"layer_idx and stage must be >= 0, got {layer_idx}, {stage}")
    for name, limit, value in (
        ("num_layers", options.num_layers, layer_idx),
        ("num_stages", options.num_stages, stage),
    ):
        if limit is not None and value >= limit:
            raise InvalidArgument(f"{value} is outside [0, {name}={limit})")
    for name, tensor in (
        ("hidden_states", hidden_states),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
    ):
        if tensor.device != device:
            raise InvalidArgument(
                f"{name} is on {tensor.device} but this transport's {carrier} is on {device}; "
                f"move the inputs there first"
            )
    if hidden_states.requires_grad:
        raise InvalidArgument(
            "hidden_states requires grad; dispatch under torch.inference_mode() or "
            "torch.no_grad() (the wire carries values, not autograd history)"
        )


class Connection(Protocol):
    """One rank's open link to the opposite role; it makes this rank's endpoint.

    What a process launcher hands to a rank program, whatever the backend: the program
    asks for the endpoint of its role and never needs to know the transport.
    """

    @property
    def role(self) -> Role: ...

    @property
    def rank(self) -> int: ...

    @property
    def layout(self) -> SlotLayout:
        """The deployment's geometry: topology, hidden size, capacities, dtype, top-k."""

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors must live."""

    def attention_endpoint(self, options: EndpointOptions | None = None) -> AttentionEndpoint:
        """This attention rank's endpoint (``InvalidArgument`` on an FFN rank)."""

    def ffn_endpoint(self, options: EndpointOptions | None = None) -> FFNEndpoint:
        """This FFN rank's endpoint (``InvalidArgument`` on an attention rank)."""

    def abort(self) -> None:
        """Tell every peer that this rank failed (best effort, idempotent)."""

    def close(self) -> None:
        """Release everything this connection holds (idempotent)."""


class RankConnection:
    """What every :class:`Connection` reports, held: the base of connections that store
    their rank's identity rather than read it from a transport (CAM's operators, a rank
    with no peers). A subclass makes the endpoints and releases what it opened."""

    def __init__(
        self, layout: SlotLayout, role: Role | str, rank: int, device: torch.device
    ) -> None:
        self._layout = layout
        self._role = Role(role)
        layout.topology.world_rank(self._role, rank)  # validates the rank
        self._rank = rank
        self._device = device

    @property
    def role(self) -> Role:
        return self._role

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def layout(self) -> SlotLayout:
        """The deployment's geometry: topology, hidden size, capacities, dtype, top-k."""
        return self._layout

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors must live."""
        return self._device


__all__ = [
    "AttentionEndpoint",
    "Connection",
    "DispatchHandle",
    "EndpointOptions",
    "FFNEndpoint",
    "RankConnection",
    "check_dispatch_inputs",
]
