"""The attention window endpoint with device kernels (:mod:`.kernel_specs`), and the window
connection that makes it.

:class:`KernelAttentionEndpoint` extends afd_protocol's portable
:class:`~afd_protocol.window.WindowAttentionEndpoint` through its extension surface (that
class's docstring); :class:`KernelWindowConnection` makes it, and the FFN endpoint with the
kernels' ``per_rank`` reduce (the NVSHMEM transport's connection passes its Triton kernels;
tests pass :data:`~.kernel_specs.REFERENCE_KERNELS`, the torch references). The kernels are
chosen once, when the endpoint is made:

* **fused combine** (``combine="auto"`` or ``"fused"``): the plan's segment bounds go to
  the device with the dispatch (through pinned memory, no host wait), and ``combine``
  runs one kernel that reads every token's reply rows where they landed;
* **device pack** (by default where the kernels have one; ``device_pack=False`` turns it
  off): when no FFN rank can overflow even if
  every row went to it, the plan stays on the device (:func:`~afd_protocol.core.plan.
  plan_on_device`) and one kernel writes every destination's rows and complete header.
  Every FFN rank is then published to (one that got nothing serves an empty part), and
  the expert-id range check, read back behind the pack, is raised at ``combine``. In the
  ``per_rank`` format a rank gets at most one row per token, so with replies reduced on
  the FFN side every batch within ``token_cap`` is packed on the device; those replies
  are combined by the fused kernel with one unit-weight "choice" per FFN rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from afd_protocol import (
    HEADER_FIXED_WORDS,
    DevicePlan,
    DispatchPlan,
    EndpointOptions,
    Header,
    InvalidArgument,
    WireOrder,
    check_expert_bounds,
    constant_index,
    encode_fixed_words,
)
from afd_protocol.window import (
    ExpectedReply,
    PinnedReadback,
    PinnedUpload,
    WindowAttentionEndpoint,
    WindowConnection,
    WindowDispatch,
    WindowFFNEndpoint,
    WindowTransport,
)

if TYPE_CHECKING:
    from afd_transport_nvshmem.graphed_ffn import ExpertStep, GraphedFFNServer, ServeGraphOptions
from afd_transport_nvshmem.kernel_specs import (
    CombineInputs,
    PackInputs,
    TokenRowInputs,
    WindowKernels,
    crc_tables,
)


class KernelAttentionEndpoint(WindowAttentionEndpoint):
    """:class:`~.attention.WindowAttentionEndpoint` with device kernels (module docstring)."""

    def __init__(
        self,
        transport: WindowTransport,
        options: EndpointOptions | None,
        kernels: WindowKernels,
    ) -> None:
        self._kernels = kernels
        super().__init__(transport, options)

    def _setup(self) -> None:
        super()._setup()
        kernels = self._kernels
        transport = self._transport
        # Replies reduced on the FFN side need no weighting: the portable sum is all there is.
        self._fused = self.options.combine != "portable" and not self._reduced_replies
        wanted = self.options.device_pack
        if wanted is None:  # auto: wherever the kernels can, unless the combine is portable
            wanted = self.options.combine != "portable"
        self._pack = kernels.device_pack if wanted else None
        device = transport.device
        ffn_ranks = range(self._topology.num_ffn_ranks)
        rings = range(self._window.ring_depth)
        dtype = self.dtype
        self._rows = transport.local_window().view(dtype)

        def starts(field: str, ring: int) -> torch.Tensor:
            offsets = [
                self._window.field_offset(d, ring, field) // dtype.itemsize for d in ffn_ranks
            ]
            return torch.tensor(offsets, dtype=torch.int64, device=device)

        self._uploads = PinnedUpload(device)
        self._segments = [
            torch.zeros(self._topology.num_ffn_ranks + 1, dtype=torch.int64, device=device)
            for _ in rings
        ]
        self._routed_starts = [starts("routed_rows", r) for r in rings]
        self._shared_starts = (
            [starts("shared_rows", r) for r in rings] if self._slot.shared_cap else None
        )
        shape = (self._topology.num_ffn_ranks, HEADER_FIXED_WORDS)
        self._fixed_words = [torch.zeros(shape, dtype=torch.int32, device=device) for _ in rings]
        self._readback = PinnedReadback(device)
        placement = self._topology.expert_placement
        self._crc_base, self._crc_columns = crc_tables(placement, device)
        # The weights of replies reduced on the FFN side, made once (not per layer).
        unit = (self._slot.token_cap, self._topology.num_ffn_ranks)
        self._unit_weights = torch.ones(unit, dtype=torch.float32, device=device)
        self._expert_owner = constant_index(placement.owner, device).to(torch.int32)
        self._expert_local_id = constant_index(placement.local_id, device).to(torch.int32)

    def _check_kernel_options(self) -> None:
        if self.options.device_pack is True and self._kernels.device_pack is None:
            raise InvalidArgument(
                f"device_pack=True, but the kernels of {type(self._transport).__name__} have no "
                f"device pack; use device_pack=None (auto) or False"
            )
        if self.options.combine == "fused" and self._reduced_replies:
            raise InvalidArgument(
                "combine='fused' weights per-partial replies, but with combine_reduce='ffn' "
                "the FFN side already did; use combine='auto' or 'portable'"
            )

    def _plan(self, topk_ids: torch.Tensor) -> WireOrder:
        if self._packs_on_device(topk_ids):
            slot = self._slot
            return self._kernels.device_plan(
                topk_ids,
                self._topology,
                slot.shared_placement,
                slot.wire_format,
                per_partial_order=not self._reduced_replies,
            )
        return super()._plan(topk_ids)

    def _packs_on_device(self, topk_ids: torch.Tensor) -> bool:
        """Whether this dispatch can skip the host read of the counts: no destination can
        overflow even if every row goes to it (and there is something to send)."""
        num_tokens, topk = topk_ids.shape
        slot = self._slot
        return (
            self._pack is not None
            and 0 < num_tokens <= slot.token_cap
            and slot.slot_rows(num_tokens * topk, num_tokens) <= slot.routed_cap
        )

    def _send(self, handle: WindowDispatch, hidden_states: torch.Tensor) -> None:
        plan = handle.plan
        if isinstance(plan, DevicePlan):
            self._send_packed(handle, plan, hidden_states)
            handle.device_segments = plan.segment_offsets
            if self._reduced_replies:
                handle.device_segments = plan.token_row_offsets
                plan.token_row_positions  # noqa: B018 - computed while the FFN ranks work
                return
        else:
            super()._send(handle, hidden_states)
            assert isinstance(plan, DispatchPlan)
            if self._fused:
                segments = self._segments[handle.ring]
                self._uploads.copy(segments, plan.segment_offsets, handle.ring)
                handle.device_segments = segments
        if handle.device_segments is not None:
            # Ready before the replies are: computed while the FFN ranks work.
            plan.wire_position  # noqa: B018 - computes and caches it now

    def _send_packed(
        self, handle: WindowDispatch, plan: DevicePlan, hidden_states: torch.Tensor
    ) -> None:
        """Every FFN rank gets this layer: rows and headers written by the device pack."""
        ring = handle.ring
        headers = self._packed_headers(handle)
        self._uploads.copy(self._fixed_words[ring].view(-1), fixed_words(headers), ("fixed", ring))
        self._pack_rows(ring, plan, hidden_states, handle.topk_ids, handle.topk_weights)
        self._readback.start(plan.expert_bounds, ring)
        flag = self._window.flag_index(self._rank, ring)
        ffn_ranks = list(range(self._topology.num_ffn_ranks))
        self._transport.publish_all(ffn_ranks, flag, [h.seq for h in headers])
        self._expect(handle, headers)

    def _packed_headers(self, handle: WindowDispatch) -> list[Header]:
        """Every FFN rank's header of a packed dispatch (ROUTED_ROWS, the counts and the
        checksum are left for the pack to write); each takes a sequence number."""
        return [
            self._header(handle, dest, 0, (0,) * self._slot.num_local_experts(dest))
            for dest in range(self._topology.num_ffn_ranks)
        ]

    def _expect(self, handle: WindowDispatch, headers: list[Header]) -> None:
        """Record what every FFN rank's reply to a packed dispatch must say."""
        for dest, header in enumerate(headers):
            handle.expected[dest] = ExpectedReply(header.seq, None, header.shared_rows)

    def _pack_rows(
        self,
        ring: int,
        plan: DevicePlan,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        hidden_address: torch.Tensor | None = None,
    ) -> None:
        """Enqueue the writes of a packed dispatch into ring ``ring`` of every FFN rank: shared
        rows, then the device pack (rows, route index, headers from ``_fixed_words[ring]``).
        ``hidden_states`` ``[T, H]``, ``topk_ids`` and ``topk_weights`` ``[T, k]``, all on
        this rank's device; no host read (a CUDA graph can hold it). ``hidden_address``
        (int64 ``[1]`` on the device): the pack reads the routed rows from that address
        instead of ``hidden_states`` (:attr:`~.kernel_specs.PackInputs.hidden_address`;
        shared rows still come from ``hidden_states``)."""
        assert self._pack is not None
        ffn_ranks = range(self._topology.num_ffn_ranks)
        for dest in ffn_ranks:
            self._write_shared_rows(plan, ring, hidden_states, dest)
        views = [self._send_views[d][ring] for d in ffn_ranks]
        token_rows = None
        if self._slot.per_rank:
            token_rows = TokenRowInputs(
                topk_ids=topk_ids,
                topk_weights=topk_weights,
                expert_owner=self._expert_owner,
                expert_local_id=self._expert_local_id,
                route_ids=tuple(v.route_ids for v in views),
                route_weights=tuple(v.route_weights for v in views),
            )
        self._pack(
            PackInputs(
                hidden=hidden_states,
                plan=plan,
                rank_wire_offsets=self._topology.expert_placement.rank_wire_offsets,
                fixed_words=self._fixed_words[ring],
                routed_rows=tuple(v.routed_rows for v in views),
                route_index=tuple(v.route_index for v in views),
                headers=tuple(v.header for v in views),
                crc_base=self._crc_base,
                crc_columns=self._crc_columns,
                token_row_inputs=token_rows,
                hidden_address=hidden_address,
            )
        )

    def _combine_arrived(self, handle: WindowDispatch) -> torch.Tensor:
        plan = handle.plan
        ring = handle.ring
        if isinstance(plan, DevicePlan):
            # The range check the host plan makes before writing: the bounds were read back
            # behind the pack, and the replies arriving means the stream got past it.
            low, high = self._readback.read(ring)
            if low < 0 or high >= self._topology.num_experts:
                self._release(ring)
                check_expert_bounds(low, high, self._topology.num_experts)
        if handle.device_segments is None:
            return super()._combine_arrived(handle)
        if isinstance(plan, DevicePlan) and self._reduced_replies:
            # One reply row per (token, FFN rank), already weighted: unit weights.
            wire_position = plan.token_row_positions
            weights = self._unit_weights[: plan.num_tokens]
        else:
            wire_position, weights = plan.wire_position, handle.topk_weights
        inputs = self._combine_inputs(
            ring, handle.device_segments, wire_position, weights, handle.dtype
        )
        return self._kernels.fused_combine(inputs)

    def _combine_inputs(
        self,
        ring: int,
        segments: torch.Tensor,
        wire_position: torch.Tensor,
        weights: torch.Tensor,
        dtype: torch.dtype,
    ) -> CombineInputs:
        """The fused combine's inputs for replies in ring ``ring`` (see
        :class:`~.kernel_specs.CombineInputs`)."""
        return CombineInputs(
            rows=self._rows,
            routed_starts=self._routed_starts[ring],
            shared_starts=None if self._shared_starts is None else self._shared_starts[ring],
            segment_offsets=segments,
            wire_position=wire_position,
            topk_weights=weights,
            hidden_size=self._slot.hidden_size,
            out_dtype=dtype,
        )


def fixed_words(headers: list[Header]) -> list[int]:
    """The words before the counts of every header, concatenated (``[F * FIXED]``)."""
    return [w for header in headers for w in encode_fixed_words(header)]


class KernelWindowConnection(WindowConnection):
    """A window connection whose endpoints use device kernels: the
    :class:`KernelAttentionEndpoint`, and the FFN window endpoint with the kernels'
    ``per_rank`` reduce. Pass the kernels, or override :meth:`endpoint_kernels` to load
    them only when an endpoint is made (the NVSHMEM transport's connection does, so Triton
    loads then)."""

    def __init__(self, transport: WindowTransport, kernels: WindowKernels | None = None) -> None:
        super().__init__(transport)
        self._kernels = kernels

    def endpoint_kernels(self) -> WindowKernels:
        """The device kernels of the endpoints made from now on."""
        if self._kernels is None:
            raise InvalidArgument(
                f"{type(self).__name__} was given no kernels: pass them, or override "
                f"endpoint_kernels()"
            )
        return self._kernels

    def attention_endpoint(self, options: EndpointOptions | None = None) -> KernelAttentionEndpoint:
        """This attention rank's endpoint, with the kernels."""
        return KernelAttentionEndpoint(self.transport, options, self.endpoint_kernels())

    def ffn_endpoint(self, options: EndpointOptions | None = None) -> WindowFFNEndpoint:
        """This FFN rank's endpoint; its ``per_rank`` parts reduce with the kernels' reduce."""
        return WindowFFNEndpoint(self.transport, options, self.endpoint_kernels().reduce_partials)

    def graphed_ffn_server(
        self,
        step: ExpertStep,
        options: EndpointOptions | None = None,
        graph: ServeGraphOptions | None = None,
    ) -> GraphedFFNServer:
        """This FFN rank's serve loop replayed from a CUDA graph around the expert ``step``
        (:class:`~afd_transport_nvshmem.graphed_ffn.GraphedFFNServer`; Triton loads now)."""
        from afd_transport_nvshmem.graphed_ffn import GraphedFFNServer

        return GraphedFFNServer(self.transport, step, options, graph)
