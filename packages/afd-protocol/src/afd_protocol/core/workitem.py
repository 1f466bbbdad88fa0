"""Work items: what an FFN rank receives, whatever the transport.

Contract (seed 002): a work item is one attention DP replica x one layer x one stage. It
is ready only when every participant of the replica has published its part; an FFN rank
may take any ready item but must not starve one. The FFN side never routes: each part
carries its group list, and in the ``per_rank`` wire format each token row its local
expert ids and weights.

An FFN computes every part the same way, whatever the wire format::

    rows, group_list = part.grouped()     # rows grouped by local expert, ascending
    out = experts(rows, group_list)       # one output row per input row
    reply_rows = part.finish(out)         # what reply() expects for this part
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorkItemKey:
    """Identity of a work item."""

    replica: int
    layer: int
    stage: int


@dataclass(frozen=True)
class PartialsToReduce:
    """What the FFN-side reduce of a ``per_rank`` part reads (:meth:`WorkItemPart.finish`)."""

    out: torch.Tensor
    """``[P, H]``: the expert output of every partial, grouped by local expert."""
    slots: torch.Tensor
    """int64 ``[P]``: each partial's flat ``(row, choice)`` slot ``row * k + j``."""
    route_ids: torch.Tensor
    """int32 ``[R, k]``: local expert ids, -1 where the choice is on another FFN rank."""
    route_weights: torch.Tensor
    """fp32 ``[R, k]``: the routing weights."""


PartialsReduce = Callable[[PartialsToReduce], torch.Tensor]
"""``reply[r] = sum_j w[r, j] * out[partial at slot r * k + j]`` over the choices on this
rank, in fp32, returned ``[R, H]`` in ``out``'s dtype. A device kernel replaces
:func:`reference_reduce_partials` (on a GPU, one pass instead of five)."""


def reference_reduce_partials(inputs: PartialsToReduce) -> torch.Tensor:
    """The reduce written with torch ops: a batched ``[1, k] x [k, H]`` product per row over
    the partials placed at their ``(row, choice)`` slots (zero where the choice is on
    another rank); no atomics, so deterministic on every device."""
    out = inputs.out
    rows, topk = inputs.route_ids.shape
    hidden = out.shape[1]
    slots = torch.zeros(rows * topk, hidden, dtype=torch.float32, device=out.device)
    slots.index_copy_(0, inputs.slots.to(out.device), out.float())
    weights = inputs.route_weights.to(out.device, torch.float32).masked_fill(
        inputs.route_ids.to(out.device) < 0, 0.0
    )
    reduced = torch.bmm(weights.unsqueeze(1), slots.view(rows, topk, hidden))
    return reduced.squeeze(1).to(out.dtype)


@dataclass(frozen=True)
class WorkItemPart:
    """One participant's rows, as zero-copy views where the transport received them."""

    src_rank: int
    """The attention rank that sent this part."""
    num_tokens: int
    """Tokens in the sender's batch (each may appear in several routed rows)."""
    routed_rows: torch.Tensor
    """``[R, H]`` in the activation dtype, grouped by local expert in ascending order."""
    shared_rows: torch.Tensor
    """``[S, H]`` (``S = 0`` unless shared experts run on the FFN side)."""
    group_list: torch.Tensor
    """int64 ``[num_local_experts]`` on the receiving device: rows per local expert
    (count-type), summing to ``R``."""
    layer_index: torch.Tensor
    """``[1]`` integer tensor on the receiving device holding the layer, for device code
    (a graph or a layer-select kernel) that must not read it through the host."""
    route_ids: torch.Tensor | None = None
    """``per_rank`` only: int32 ``[R, k]``, each token row's local expert ids, -1 where the
    choice is on another FFN rank; ``routed_rows`` then holds one row per token."""
    route_weights: torch.Tensor | None = None
    """``per_rank`` only: fp32 ``[R, k]``, the routing weights beside ``route_ids``."""
    reduce_on_ffn: bool = False
    """``per_rank`` with ``combine_reduce="ffn"``: the reply is one row per token row, the
    weighted sum of its partials (``finish`` computes it)."""
    partials_hint: int | None = None
    """``per_rank``: the number of partials as the header announced it (the sum of the
    group list, known on the host), so expanding needs no device-to-host read."""
    reduce_kernel: PartialsReduce | None = None
    """The device kernel ``finish`` reduces with (None: :func:`reference_reduce_partials`);
    set by an endpoint whose backend has one."""

    @property
    def num_partials(self) -> int:
        """(token, expert) partials this part asks for: rows once expanded."""
        if self.route_ids is None:
            return int(self.routed_rows.shape[0])
        return self._expansion[0].numel()

    @property
    def num_reply_rows(self) -> int:
        """Rows of this part in ``reply``'s ``routed_out``."""
        if self.route_ids is None or not self.reduce_on_ffn:
            return self.num_partials
        return int(self.routed_rows.shape[0])

    @functools.cached_property
    def _expansion(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``per_rank``: for every partial, grouped by local expert (a stable sort, so in token
        order within an expert, as ``per_choice`` sends), its flat ``(row, choice)`` index
        ``row * k + j`` and its token row."""
        assert self.route_ids is not None
        topk = self.route_ids.shape[1]
        ids = self.route_ids.reshape(-1).long()
        num_local = self.group_list.numel()
        key = torch.where(ids >= 0, ids, num_local)
        order = torch.sort(key, stable=True).indices
        partials = self.partials_hint
        if partials is None:
            partials = int((ids >= 0).sum())
        order = order[:partials]
        return order, torch.div(order, topk, rounding_mode="floor")

    def grouped(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [P, H], group_list)``: one row per partial, grouped by local expert.

        ``per_choice`` rows already are (no copy); ``per_rank`` token rows are expanded.
        """
        if self.route_ids is None:
            return self.routed_rows, self.group_list
        _, rows = self._expansion
        return self.routed_rows.index_select(0, rows), self.group_list

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """This part's reply rows from ``out [P, H]``, the expert outputs of ``grouped()``'s rows.

        Unchanged unless the FFN side reduces: then each token row's partials are weighted
        and summed in fp32 and returned in ``out``'s dtype, one row per token row
        (:data:`PartialsReduce`, deterministic).
        """
        if not self.reduce_on_ffn:
            return out
        assert self.route_ids is not None
        assert self.route_weights is not None
        order, _ = self._expansion
        reduce = self.reduce_kernel or reference_reduce_partials
        return reduce(PartialsToReduce(out, order, self.route_ids, self.route_weights))


@dataclass(frozen=True)
class WorkItem:
    """A ready work item: all participants of one replica at one (layer, stage)."""

    key: WorkItemKey
    parts: tuple[WorkItemPart, ...]

    @property
    def replica(self) -> int:
        return self.key.replica

    @property
    def layer(self) -> int:
        return self.key.layer

    @property
    def stage(self) -> int:
        return self.key.stage

    @property
    def num_routed_rows(self) -> int:
        """Rows ``reply`` expects in ``routed_out``: each part's ``finish`` output, concatenated."""
        return sum(p.num_reply_rows for p in self.parts)

    @property
    def num_shared_rows(self) -> int:
        """Rows ``reply`` expects in ``shared_out`` (0: pass None)."""
        return sum(int(p.shared_rows.shape[0]) for p in self.parts)
