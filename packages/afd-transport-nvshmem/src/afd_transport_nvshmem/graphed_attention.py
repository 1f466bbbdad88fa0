"""The kernel attention endpoint with its per-layer exchange replayed from CUDA graphs.

Eagerly, one packed dispatch costs the host dozens of launches (the plan's torch ops, the
pack, the publish) and one combine a Triton launch: about a millisecond per MoE layer on
an H200, against microseconds of data movement. Within one prefill step every MoE layer
sees the same token count, so :class:`GraphedAttentionEndpoint` captures the device half of
a packed dispatch -- plan on the device, shared rows, pack, the expert-bound readback,
the flag publish -- and of its fused combine as CUDA graphs, one pair per (token count,
ring slot), and replays them. What changes from layer to layer reaches the graphs through
memory whose address the graphs hold:

* the layer's hidden states, top-k ids and weights are copied into the graph's own input
  tensors (three device copies);
* the header words of every FFN rank (sequence number, layer, stage, token count) are
  written into a page-locked block that the graph copies to the device;
* the flag values go into the :class:`~afd_protocol.window.PublishBlock` of the ring,
  whose launch (captured) reads them when it runs.

So the host per layer writes a few dozen words and launches two replays. The first use of
a (token count, ring) runs eagerly (it compiles and loads every kernel, which a capture
cannot), the second captures both graphs (the first was combined before the ring was
free again); at most ``max_token_counts`` counts are held (least
recently used dropped). The combine replays its graph and returns a copy of the graph's
output (the next replay of the same graph overwrites it).

The wait for the replies is part of the combine graph (``combine_wait``, on a CUDA device
by default): a bounded device wait for *every* expected reply
(:class:`~afd_transport_nvshmem.device_wait.WaitBlock`) runs right before the fused
combine, so the combine starts the moment the last reply lands, with no host reaction in
between; ``combine()`` enqueues it (and the copy of the output) and then checks, on the
host, the status and every reply's header the wait captured -- the output is returned
only when all of them are right, so an error is still raised by the ``combine`` it
concerns. A wait whose poll budget ran out is replayed again (its output discarded); a
watched FFN rank that aborted or died is a named error within the timeout (the host checks
the peers while it reads the status). Without a combine wait, the transport's own bounded
device wait runs first, as for the eager endpoint.

With ``defer_checks=True`` the host does not wait at all: ``combine()`` enqueues the
replay (its wait bounded by a GPU clock deadline, the timeout) and returns the output at
once, so the host can run layers ahead of the device. The replies and the expert-id range
of a deferred combine are checked at the next combine on its ring, at :meth:`flush` or at
``announce_shutdown()`` -- every error the immediate check raises, raised there instead
(and every other unchecked combine cancelled). The host stalls only where it would
overwrite words a queued dispatch has yet to read: a ring's next dispatch waits for the
ring's last dispatch to have run (the graphs' header words and input addresses, and the
flag values, whose page-locked block the transport shares between a ring's token counts);
a deferred wait's clock deadline starts when the device reaches it, and so does the host's
bound on it. Call ``flush()`` before trusting a forward pass's outputs; ``close()`` cancels
what is unchecked, lets the device run through the cancelled waits and records the flag
values of replies that had arrived, so a later endpoint on the transport expects the next.

Outputs equal the eager kernel endpoint's exactly: the same kernels run on the same
values. A dispatch the device pack cannot take (too many rows for a slot) runs eagerly.
:data:`GraphCapture` is how a graph is made: :class:`CudaGraphCapture` on a GPU; tests on
the CPU pass :func:`replayed_calls`, which re-runs the captured calls with the arguments
of capture time -- what a graph does -- so a value the host forgot to route through
memory shows up as a stale header.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from afd_protocol import (
    HEADER_FIXED_WORDS,
    AFDError,
    DevicePlan,
    DispatchHandle,
    EndpointOptions,
    Header,
    PeerAborted,
    PeerTimeout,
    SharedPlacement,
    WireOrder,
    Word,
    check_expert_bounds,
)
from afd_protocol.window import (
    Arrivals,
    ExpectedReply,
    PublishBlock,
    WindowDispatch,
    WindowTransport,
    abort_words,
)
from afd_transport_nvshmem.combine_wait import (
    MAX_DEADLINE_US,
    WAIT_POLLS,
    CombineWait,
    CombineWaitFactory,
    PeerCheck,
    PolledCombineWait,
    abandon,
    device_combine_wait,
    kernel_combine_wait,
)
from afd_transport_nvshmem.graph_capture import (
    CudaGraphCapture,
    GraphCapture,
    Replay,
    replayed_calls,
)
from afd_transport_nvshmem.kernel_attention import KernelAttentionEndpoint, fixed_words
from afd_transport_nvshmem.kernel_specs import WindowKernels

__all__ = [
    "CombineWait",
    "CudaGraphCapture",
    "GraphCapture",
    "GraphedAttentionEndpoint",
    "PolledCombineWait",
    "Replay",
    "device_combine_wait",
    "kernel_combine_wait",
    "replayed_calls",
]

_T = TypeVar("_T")


@dataclass
class _LayerGraphs:
    """The graphs of one (token count, ring) and the memory they read and write."""

    hidden: torch.Tensor
    """``[T, H]`` activation dtype, device: the dispatch graph's input rows."""
    topk_ids: torch.Tensor
    """``[T, k]`` the caller's integer dtype, device."""
    topk_weights: torch.Tensor
    """``[T, k]`` the caller's floating dtype, device."""
    fixed_host: torch.Tensor
    """int32 ``[F * HEADER_FIXED_WORDS]``, page-locked: the next dispatch's header words."""
    fixed_words: Any
    """A ``ctypes`` int32 array over :attr:`fixed_host`."""
    bounds_host: torch.Tensor
    """int64 ``[2]``, page-locked: the smallest and largest expert id, read back."""
    publish: PublishBlock
    sources_host: torch.Tensor | None = None
    """int64 ``[3]``, page-locked: the addresses of the next dispatch's hidden states, ids
    and weights, which the dispatch graph fetches (``None``: the kernels have no fetch, so
    the host copies them in)."""
    sources: Any = None
    """A ``ctypes`` int64 array over :attr:`sources_host`."""
    sources_device: torch.Tensor | None = None
    """int64 ``[3]`` on the device: :attr:`sources_host` as the fetch kernel reads it."""
    fetched: tuple[torch.Tensor, ...] = ()
    """The tensors at :attr:`sources_host`'s addresses, held until this entry's next
    dispatch (its ring was combined by then, so the graph has read them): the caller may
    drop its own references, or allocate them on another stream, as soon as
    ``dispatch()`` returns."""
    dispatch: Replay | None = None
    plan: DevicePlan | None = None
    """The captured plan: its tensors hold the last replay's values."""
    wire_position: torch.Tensor | None = None
    """What the fused combine reads for each partial (or (token, FFN rank))."""
    combine: Replay | None = None
    combine_out: torch.Tensor | None = None
    """``[T, H]`` activation dtype: the combine graph's output."""
    header_words: _HeaderWords | None = None
    """The replays' header words with the per-dispatch ones left to fill (made from the
    first replay's headers)."""


_INT32_MAX = 2**31 - 1
_PER_DISPATCH = (Word.LAYER, Word.STAGE, Word.SEQ)
"""The header words that differ between dispatches replayed from one graph."""


@dataclass(frozen=True)
class _HeaderWords:
    """Every FFN rank's fixed header words of a replayed dispatch, as
    :func:`~.kernel_attention.fixed_words` encodes them, with LAYER, STAGE and SEQ zero;
    the rest (kind, source rank, token count, shared rows, flags, count of experts) is
    fixed by the graph's token count and plan. Filling the three words costs the host a
    list copy where building and encoding a :class:`~afd_protocol.Header` per FFN rank
    cost it about as much as the rest of ``dispatch()``."""

    words: tuple[int, ...]
    shared_rows: tuple[int, ...]
    """Each FFN rank's shared-expert rows (what its reply must say)."""

    @classmethod
    def of(cls, headers: Sequence[Header]) -> _HeaderWords:
        words = fixed_words(list(headers))
        for dest in range(len(headers)):
            for word in _PER_DISPATCH:
                words[dest * HEADER_FIXED_WORDS + word] = 0
        return cls(tuple(words), tuple(h.shared_rows for h in headers))

    def fill(self, layer: int, stage: int, seqs: Sequence[int]) -> list[int]:
        """The words of a dispatch of ``layer`` and ``stage`` whose FFN ranks get
        ``seqs`` (one each, in rank order)."""
        words = list(self.words)
        for dest, seq in enumerate(seqs):
            base = dest * HEADER_FIXED_WORDS
            words[base + Word.LAYER] = layer
            words[base + Word.STAGE] = stage
            words[base + Word.SEQ] = seq
        return words


@dataclass(frozen=True)
class _Pending:
    """A deferred combine: what its check needs once its wait has reported."""

    handle: WindowDispatch
    wait: CombineWait
    dests: list[int]
    """The FFN ranks it waits for, ascending."""
    indices: list[int]
    """Their flag indices on the handle's ring."""
    limit: float
    """The timeout it was enqueued with, seconds."""
    queued: torch.Event | None
    """Recorded right before the combine graph (None on the CPU, where the wait ran when
    launched): until it has completed the wait has not started (the host may be ahead of
    the device), nor has its deadline, :attr:`limit` from then."""
    done: torch.Event | None
    """Recorded behind the combine graph's last node (None on the CPU)."""
    entry: _LayerGraphs
    """The graphs it replayed and the memory they use, held until it is checked (the
    least-recently-used drop could otherwise free them while they still run)."""


def _deadline_us(seconds: float) -> int:
    """A wait's deadline in whole microseconds, within what a request holds."""
    return max(1, min(MAX_DEADLINE_US, round(seconds * 1e6)))


class GraphedAttentionEndpoint(KernelAttentionEndpoint):
    """:class:`~.kernel_attention.KernelAttentionEndpoint` whose packed dispatch and fused
    combine replay CUDA graphs (module docstring). ``max_token_counts`` (>= 1) bounds the
    token counts held as graphs; ``capture`` makes them (default: :class:`CudaGraphCapture`
    on the transport's device)."""

    def __init__(
        self,
        transport: WindowTransport,
        options: EndpointOptions | None,
        kernels: WindowKernels,
        max_token_counts: int = 8,
        capture: GraphCapture | None = None,
        combine_wait: CombineWaitFactory | None = device_combine_wait,
        defer_checks: bool = False,
    ) -> None:
        if max_token_counts < 1:
            raise ValueError(
                f"max_token_counts must be >= 1 (the token counts held as graphs), got "
                f"{max_token_counts}; use the kernel endpoint for an eager exchange"
            )
        self._max_counts = max_token_counts
        self._capture: GraphCapture = capture or CudaGraphCapture(transport.device)
        self._graphs: OrderedDict[int, dict[int, _LayerGraphs]] = OrderedDict()
        self._eager_keys: set[tuple[int, int, torch.dtype, torch.dtype]] = set()
        """(token count, ring, id and weight dtypes) dispatched eagerly once (so their
        kernels are loaded)."""
        self._replayed: dict[int, _LayerGraphs] = {}
        """Per ring in flight, the graphs its dispatch replayed (kept if dropped meanwhile)."""
        self.replays = 0
        """Dispatches that replayed a graph (a capture counts as one)."""
        self.captures = 0
        """Graphs captured (dispatch and combine count one each)."""
        self.capture_seconds = 0.0
        """Host time spent capturing them (and instantiating: what a new count costs)."""
        self.graph_waits = 0
        """Combines whose wait ran inside their graph (the rest waited on the host first)."""
        self.wait_seconds = 0.0
        """Host time those combines spent spinning on their wait's status word (the rest of
        a combine's host time is its own work: the replay, the checks of the replies)."""
        self._combine_wait = combine_wait
        self._waits: dict[int, CombineWait] = {}
        """Per ring, the wait its combine graphs hold (made with the ring's first graphs)."""
        self._defer = defer_checks
        self._pending: dict[int, _Pending] = {}
        """Per ring, the deferred combine not yet checked (in the order enqueued)."""
        self._ring_dispatched: dict[int, torch.Event] = {}
        """On a GPU, per ring, recorded behind its last dispatch (eager or replayed): once
        complete, that dispatch has read what the host staged for it and, replayed, read
        its expert-id range back."""
        self._ring_combine_events: dict[int, tuple[torch.Event, torch.Event]] = {}
        """``defer_checks`` on a GPU, per ring: recorded before and behind its combine graph."""
        self._ring_bounds: dict[int, torch.Tensor] = {}
        """Per ring, int64 ``[2]`` (page-locked on a GPU): the smallest and largest expert
        id of its last deferred combine's dispatch, read back by the combine graph."""
        super().__init__(transport, options, kernels)
        if self._pack is None:
            self.close()  # the window is free for another endpoint
            raise ValueError(
                "graph replay needs the device pack (which the fused combine reads); leave "
                "device_pack and combine at their defaults (or use the kernel endpoint)"
            )

    @property
    def token_counts(self) -> tuple[int, ...]:
        """The token counts held as graphs now, least recently used first."""
        return tuple(self._graphs)

    # ---- dispatch -----------------------------------------------------------------------

    def _plan(self, topk_ids: torch.Tensor) -> WireOrder:
        entry = self._entry_for(topk_ids)
        if entry is not None and entry.plan is not None:
            return entry.plan  # the graph's plan; the replay fills it
        return super()._plan(topk_ids)

    def _entry_for(self, topk_ids: torch.Tensor) -> _LayerGraphs | None:
        ring = self._next_ring()
        if ring is None or not self._packs_on_device(topk_ids):
            return None
        entry = self._graphs.get(topk_ids.shape[0], {}).get(ring)
        # Graphs copy into inputs of the dtypes they were made with: another is another key.
        return entry if entry is not None and entry.topk_ids.dtype == topk_ids.dtype else None

    def _send(self, handle: WindowDispatch, hidden_states: torch.Tensor) -> None:
        if self._defer:
            # The host may be layers ahead of the device, and a dispatch stages words in
            # page-locked memory the ring's last one may not have read yet: the header words
            # and input addresses of a (token count, ring)'s graphs, and the flag values,
            # whose block the transport shares between a ring's token counts. (Checked at
            # once, the ring's last combine waited for its replies, so it has run.)
            self._await_ring_dispatch(handle.ring)
        self._send_now(handle, hidden_states)
        if self.device.type == "cuda":
            event = self._ring_dispatched.get(handle.ring)
            if event is None:
                event = self._ring_dispatched[handle.ring] = torch.Event(device=self.device)
            event.record()  # the current stream

    def _await_ring_dispatch(self, ring: int) -> None:
        """Wait until ``ring``'s last dispatch has run on the device."""
        event = self._ring_dispatched.get(ring)
        if event is not None and not event.query():
            event.synchronize()

    def _send_now(self, handle: WindowDispatch, hidden_states: torch.Tensor) -> None:
        num_tokens = hidden_states.shape[0]
        # The dtypes too: a kernel compiled for other pointer types would load in a capture.
        key = (num_tokens, handle.ring, handle.topk_ids.dtype, handle.topk_weights.dtype)
        if not isinstance(handle.plan, DevicePlan):
            super()._send(handle, hidden_states)  # too many rows for the device pack
            return
        if key not in self._eager_keys:
            self._eager_keys.add(key)  # first use: eager, which loads every kernel
            if self._replays_into(handle.plan):  # another dtype's graph plan: plan afresh
                handle.plan = super()._plan(handle.topk_ids)
            super()._send(handle, hidden_states)
            return
        entry = self._layer_graphs(num_tokens, handle.ring, hidden_states, handle)
        self._stage_inputs(entry, (hidden_states, handle.topk_ids, handle.topk_weights))
        seqs, shared_rows = self._write_headers(entry, handle)
        entry.publish.write(seqs)
        if entry.dispatch is None:
            # The ring's first dispatch at this count was combined before this one could
            # take the ring, so the combine's kernel is loaded too: capture both now.
            self._capture_dispatch(entry, handle.ring)
            self._capture_combine(entry, handle.ring, handle.dtype)
        assert entry.dispatch is not None
        assert entry.plan is not None
        entry.dispatch()
        self.replays += 1
        handle.plan = entry.plan
        self._replayed[handle.ring] = entry
        handle.device_segments = (
            entry.plan.token_row_offsets if self._reduced_replies else entry.plan.segment_offsets
        )
        for dest, (seq, shared) in enumerate(zip(seqs, shared_rows, strict=True)):
            handle.expected[dest] = ExpectedReply(seq, None, shared)

    def _write_headers(
        self, entry: _LayerGraphs, handle: WindowDispatch
    ) -> tuple[list[int], Sequence[int]]:
        """Write every FFN rank's fixed header words of ``handle`` where the dispatch graph
        copies them from; return the sequence numbers they took and the shared-expert rows
        they announce (one each per FFN rank, in rank order). The first replay of
        ``entry`` encodes :class:`~afd_protocol.Header` objects and keeps them as a
        template; later ones fill its per-dispatch words (a layer or stage past int32 takes
        the encoding path, which refuses it)."""
        template = entry.header_words
        if template is None or max(handle.layer, handle.stage) > _INT32_MAX:
            headers = self._packed_headers(handle)
            entry.fixed_words[:] = fixed_words(headers)
            if entry.dispatch is not None:  # so handle.plan is the graph's own
                entry.header_words = _HeaderWords.of(headers)
            return [h.seq for h in headers], [h.shared_rows for h in headers]
        next_seq = self._transport.sequence.next
        seqs = [next_seq() for _ in template.shared_rows]
        entry.fixed_words[:] = template.fill(handle.layer, handle.stage, seqs)
        return seqs, template.shared_rows

    def _stage_inputs(self, entry: _LayerGraphs, inputs: tuple[torch.Tensor, ...]) -> None:
        """Where the dispatch graph reads the layer's hidden states, ids and weights from:
        their addresses, fetched inside the graph (no host launch), or -- without a fetch
        kernel, or for an input that is not contiguous -- copies into the graph's own
        buffers (whose addresses the fetch then reads: a copy onto itself)."""
        owned = (entry.hidden, entry.topk_ids, entry.topk_weights)
        if entry.sources is None:
            for mine, theirs in zip(owned, inputs, strict=True):
                mine.copy_(theirs)
            return
        # Shapes and device need no comparing here: check_dispatch_inputs checked them
        # against the layout and the transport, and the entry's key is the token count.
        fetched = []
        for index, (mine, theirs) in enumerate(zip(owned, inputs, strict=True)):
            same = theirs.dtype == mine.dtype and theirs.is_contiguous()
            source = theirs if same else mine.copy_(theirs)
            entry.sources[index] = source.data_ptr()
            fetched.append(source)
        entry.fetched = tuple(fetched)

    def _replays_into(self, plan: WireOrder) -> bool:
        """Whether ``plan`` is a graph's (its tensors hold that graph's last replay)."""
        return any(e.plan is plan for rings in self._graphs.values() for e in rings.values())

    def _layer_graphs(
        self, num_tokens: int, ring: int, hidden: torch.Tensor, handle: WindowDispatch
    ) -> _LayerGraphs:
        """The graphs of (``num_tokens``, ``ring``), made (not captured) on first use."""
        rings = self._graphs.get(num_tokens)
        if rings is None:
            while len(self._graphs) >= self._max_counts:
                self._graphs.popitem(last=False)
            rings = self._graphs[num_tokens] = {}
        self._graphs.move_to_end(num_tokens)
        entry = rings.get(ring)
        same_types = entry is not None and (
            (entry.topk_ids.dtype, entry.topk_weights.dtype)
            == (handle.topk_ids.dtype, handle.topk_weights.dtype)
        )
        if entry is None or not same_types:
            on_gpu = self.device.type != "cpu"
            words = self._topology.num_ffn_ranks * HEADER_FIXED_WORDS
            fixed = torch.zeros(words, dtype=torch.int32, pin_memory=on_gpu)
            entry = _LayerGraphs(
                # Dense row-major whatever the caller's layout (the fetch copies bytes).
                hidden=torch.empty_like(hidden, memory_format=torch.contiguous_format),
                topk_ids=torch.empty_like(handle.topk_ids, memory_format=torch.contiguous_format),
                topk_weights=torch.empty_like(
                    handle.topk_weights, memory_format=torch.contiguous_format
                ),
                fixed_host=fixed,
                fixed_words=(ctypes.c_int32 * words).from_address(fixed.data_ptr()),
                bounds_host=torch.zeros(2, dtype=torch.int64, pin_memory=on_gpu),
                publish=self._transport.publish_block(
                    list(range(self._topology.num_ffn_ranks)),
                    self._window.flag_index(self._rank, ring),
                ),
            )
            if self._kernels.fetch_inputs is not None:
                sources = torch.zeros(3, dtype=torch.int64, pin_memory=on_gpu)
                entry.sources_host = sources
                entry.sources = (ctypes.c_int64 * 3).from_address(sources.data_ptr())
                entry.sources_device = torch.zeros(3, dtype=torch.int64, device=self.device)
            entry.publish.prepare()
            rings[ring] = entry
        return entry

    def _capture_dispatch(self, entry: _LayerGraphs, ring: int) -> None:
        slot = self._slot
        fixed_device = self._fixed_words[ring].view(-1)

        fetch = self._kernels.fetch_inputs
        copy = self._kernels.copy_words
        sources, sources_host = entry.sources_device, entry.sources_host  # with a fetch
        # The pack reads the caller's rows where they are (the fetch copies only the ids and
        # weights) unless shared rows go to the FFN ranks: those are copied from the graph's
        # own buffer, which then needs them.
        rows_in_place = fetch is not None and slot.shared_placement is SharedPlacement.ATTENTION
        hidden_address = sources[:1] if rows_in_place and sources is not None else None
        bounds_in_combine = self._bounds_in_combine(ring)
        # Each word copy once before the capture, so a kernel that does them is loaded (a
        # harmless copy each: the ring is free, and the replay rewrites the bounds).
        try:
            if sources is not None and sources_host is not None:
                copy(sources, sources_host)
            copy(fixed_device, entry.fixed_host)
            copy(entry.bounds_host, torch.zeros_like(entry.bounds_host, device=self.device))
        except Exception as exc:
            raise AFDError(
                f"preparing the dispatch graph of {entry.hidden.shape[0]} tokens (ring "
                f"{ring}) failed: {exc}; use the eager kernel endpoint (no graphs)"
            ) from exc

        def body() -> tuple[DevicePlan, torch.Tensor]:
            if fetch is not None:
                assert sources is not None
                assert sources_host is not None
                copy(sources, sources_host)
                rows = entry.hidden[:0] if rows_in_place else entry.hidden
                fetch(sources, [rows, entry.topk_ids, entry.topk_weights])
            copy(fixed_device, entry.fixed_host)
            plan = self._kernels.device_plan(
                entry.topk_ids,
                self._topology,
                slot.shared_placement,
                slot.wire_format,
                per_partial_order=not self._reduced_replies,
            )
            self._pack_rows(
                ring, plan, entry.hidden, entry.topk_ids, entry.topk_weights, hidden_address
            )
            if not bounds_in_combine:
                copy(entry.bounds_host, plan.expert_bounds)
            entry.publish.launch()
            # What the combine reads, computed while the FFN ranks work.
            wire = plan.token_row_positions if self._reduced_replies else plan.wire_position
            return plan, wire

        entry.dispatch, (entry.plan, entry.wire_position) = self._captured(
            "dispatch", entry, ring, body
        )

    # ---- combine ------------------------------------------------------------------------

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        """See the base; a replayed dispatch is waited for and combined by one graph replay
        (module docstring) when this endpoint has a combine wait. With ``defer_checks``
        that replay is only enqueued: the replies are checked later (:meth:`flush`)."""
        if not isinstance(handle, WindowDispatch):
            return super().combine(handle, timeout)  # refused there
        if handle.ring in self._pending:
            self._settle(handle.ring)  # the ring's flags' last values; its results buffers
        entry = self._replayed.get(handle.ring)
        wait = self._waits.get(handle.ring)
        if (
            wait is None
            or entry is None
            or entry.combine is None
            or handle.plan is not entry.plan
            or handle.arrived
            or self._in_flight.get(handle.ring) is not handle
        ):
            return super().combine(handle, timeout)
        self._check_open()
        limit = self._timeout if timeout is None else timeout
        if self._defer:
            return self._enqueue_combine(handle, entry, wait, limit)
        output = self._wait_and_combine(handle, entry, wait, limit)
        self._release(handle.ring)
        return output

    def flush(self) -> None:
        """Check every combine still unchecked (``defer_checks``), oldest first: wait for its
        device wait (the peers watched meanwhile) and check each reply and the expert-id
        range on the host; raise the first problem (:class:`PeerTimeout`,
        :class:`PeerAborted`, :class:`ProtocolError`, :class:`InvalidArgument`). Call it
        before using the outputs of a forward pass: until then they may come from replies
        that turn out wrong. Without ``defer_checks`` (or with nothing pending) it returns
        at once."""
        for ring in list(self._pending):
            self._settle(ring)

    @property
    def unchecked(self) -> int:
        """Combines enqueued but not yet checked (``defer_checks``; see :meth:`flush`)."""
        return len(self._pending)

    def _request(
        self, handle: WindowDispatch, wait: CombineWait, limit: float, deferred: bool
    ) -> tuple[list[int], list[int]]:
        """Write the wait of ``handle``'s replies; (FFN ranks, their flag indices)."""
        dests = sorted(handle.expected)
        indices = [self._window.flag_index(d, handle.ring) for d in dests]
        seen = self._transport.seen
        last = [seen[i] for i in indices]
        if deferred:
            # One wait to the end of the timeout (no slices: its output cannot be redone).
            on_gpu = self.device.type == "cuda"
            polls = _INT32_MAX if on_gpu else WAIT_POLLS
            wait.write(indices, last, dests, polls, deadline_us=_deadline_us(limit))
        else:
            wait.write(indices, last, dests, WAIT_POLLS)
        return dests, indices

    def _enqueue_combine(
        self, handle: WindowDispatch, entry: _LayerGraphs, wait: CombineWait, limit: float
    ) -> torch.Tensor:
        """``defer_checks``: replay the combine graph (wait, kernel, bounds readback) and
        return its output, copied, without waiting; the ring is free again at once, and the
        checks wait for :meth:`_settle`."""
        assert entry.combine is not None
        assert entry.combine_out is not None
        ring = handle.ring
        dests, indices = self._request(handle, wait, limit, deferred=True)
        queued, done = self._combine_events(ring)
        if queued is not None:
            queued.record()
        entry.combine()
        output = entry.combine_out.clone()
        if done is not None:
            done.record()  # the combine kernel and the bounds readback behind the wait
        self._pending[ring] = _Pending(handle, wait, dests, indices, limit, queued, done, entry)
        del self._replayed[ring]
        self._release(ring)
        self.graph_waits += 1
        return output

    def _combine_events(self, ring: int) -> tuple[torch.Event | None, torch.Event | None]:
        """``ring``'s two events around a deferred combine graph (made once; the ring's
        combine before was checked first), or Nones on the CPU."""
        if self.device.type != "cuda":
            return None, None
        events = self._ring_combine_events.get(ring)
        if events is None:
            events = (torch.Event(device=self.device), torch.Event(device=self.device))
            self._ring_combine_events[ring] = events
        return events

    def _settle(self, ring: int) -> None:
        """Check the deferred combine of ``ring`` (see :meth:`flush`)."""
        pending = self._pending.pop(ring)
        handle, wait = pending.handle, pending.wait
        peers = PeerCheck(self._transport, pending.dests)
        try:
            # Work queued before the wait is bounded (its own waits have deadlines); the
            # wait's clock starts once the device is through it.
            while pending.queued is not None and not pending.queued.query():
                peers.when_due()
            deadline = time.monotonic() + pending.limit
            status = self._await_wait(wait, peers, deadline, pending.limit)
            self._raise_unless_arrived(status, handle, pending.dests, pending.limit)
            self._check_replies(handle, wait, pending.dests, pending.indices)
            if pending.done is not None:
                pending.done.synchronize()  # no wait left in it: a few microseconds
            low, high = (int(v) for v in self._ring_bounds[ring].tolist())
            check_expert_bounds(low, high, self._topology.num_experts)
        except BaseException:
            self._cancel_pending()  # the others' replies can no longer be trusted
            raise

    def _raise_unless_arrived(
        self, status: int, handle: WindowDispatch, dests: list[int], limit: float
    ) -> None:
        """PeerAborted (status 3) or PeerTimeout (2, 4) for a wait that did not see every
        reply."""
        if status == 1:
            return
        if status == 3:
            aborted = abort_words(self._transport.local_window(), self._window).tolist()
            raise PeerAborted(
                f"attention rank {self._rank}: FFN rank(s) "
                f"{[d for d in dests if aborted[d]]} aborted (see their own error for the "
                f"cause)"
            )
        raise PeerTimeout(
            f"attention rank {self._rank}: FFN ranks {dests} did not reply to layer "
            f"{handle.layer} stage {handle.stage} within {limit:g} s; they may be dead "
            f"or overloaded (raise the timeout if they are merely slow)"
        )

    def _check_replies(
        self, handle: WindowDispatch, wait: CombineWait, dests: list[int], indices: list[int]
    ) -> None:
        """Check every reply the wait captured against ``handle``; mark the flags seen."""
        values = wait.values(len(indices))
        arrivals = Arrivals(values, {i: wait.header(p) for p, i in enumerate(indices)})
        seen = self._transport.seen
        for dest, index, value in zip(dests, indices, values, strict=True):
            seen[index] = value
            handle.arrived[dest] = self._check_reply(
                dest, arrivals, value, handle.expected[dest], handle
            )

    def _wait_and_combine(
        self, handle: WindowDispatch, entry: _LayerGraphs, wait: CombineWait, limit: float
    ) -> torch.Tensor:
        """Replay the combine graph (its wait, then its kernel) until the wait saw every
        reply, then check the replies on the host; the graph's output, copied."""
        assert entry.combine is not None
        assert entry.combine_out is not None
        ring = handle.ring
        deadline = time.monotonic() + limit
        dests: list[int] = []
        indices: list[int] = []
        peers = PeerCheck(self._transport, sorted(handle.expected))  # one clock, every slice
        while True:
            dests, indices = self._request(handle, wait, limit, deferred=False)
            entry.combine()
            output = entry.combine_out.clone()
            status = self._await_wait(wait, peers, deadline, limit)
            if status == 1:
                break
            if status == 3 or time.monotonic() >= deadline:
                self._raise_unless_arrived(status, handle, dests, limit)
        self._check_replies(handle, wait, dests, indices)
        self._check_bounds(entry, ring)
        del self._replayed[ring]
        self.graph_waits += 1
        return output

    def _await_wait(
        self, wait: CombineWait, peers: PeerCheck, deadline: float, limit: float
    ) -> int:
        """Spin on the wait's status, checking the peers when due (also when slices end
        faster than the liveness interval)."""
        began = time.perf_counter()
        try:
            peers.when_due()
            status = wait.status()
            while status == 0:
                now = peers.when_due()
                if now >= deadline + 1.0:
                    raise PeerTimeout(
                        f"attention rank {self._rank}: the combine's device wait did not "
                        f"report within {limit:g} s"
                    )
                status = wait.status()
        except BaseException:
            if wait.status() == 0:
                # Its kernel may still write the wait's buffers: keep them; no graph holding
                # it runs again, and later combines wait on the host.
                abandon(wait)
                self._waits.clear()
                self._combine_wait = None
                self._graphs.clear()
            raise
        finally:
            self.wait_seconds += time.perf_counter() - began
        return status

    def _check_bounds(self, entry: _LayerGraphs, ring: int) -> None:
        """The expert-id range check of a replayed dispatch (read back behind its pack)."""
        self._await_ring_dispatch(ring)  # the dispatch in flight on it: this entry's
        low, high = (int(v) for v in entry.bounds_host.tolist())
        if low < 0 or high >= self._topology.num_experts:
            del self._replayed[ring]
            self._release(ring)
            check_expert_bounds(low, high, self._topology.num_experts)

    def _combine_arrived(self, handle: WindowDispatch) -> torch.Tensor:
        ring = handle.ring
        entry = self._replayed.get(ring)
        if entry is None or handle.plan is not entry.plan:
            return super()._combine_arrived(handle)  # an eager dispatch
        # The entry stays until the combine succeeded: a failed combine may be retried.
        self._check_bounds(entry, ring)
        assert entry.combine is not None
        assert entry.combine_out is not None
        entry.combine()
        output = entry.combine_out.clone()
        del self._replayed[ring]
        return output

    def announce_shutdown(self) -> None:
        """Check what is pending (:meth:`flush`), then see the base."""
        self.flush()
        super().announce_shutdown()

    def close(self) -> None:
        """Close the endpoint (see the base) and drop every graph and its buffers; a
        deferred combine still unchecked is cancelled, not checked (never raises)."""
        self._cancel_pending()
        super().close()
        self._graphs.clear()
        self._replayed.clear()
        self._eager_keys.clear()

    def _cancel_pending(self) -> None:
        """Cancel every unchecked combine, let the device run through the cancelled waits
        (each ends within a few polls), and record the flag values of those that had
        seen every reply, so a later endpoint on the transport expects the next ones.
        Never raises (a wait whose end cannot be confirmed keeps its buffers)."""
        pending = [self._pending.pop(ring) for ring in list(self._pending)]
        for item in pending:
            item.wait.cancel()
        if pending and self.device.type == "cuda":
            # close() never raises: a wait not seen to end keeps its buffers (abandon).
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
        seen = self._transport.seen
        for item in pending:
            if item.wait.status() == 1:
                for index, value in zip(
                    item.indices, item.wait.values(len(item.indices)), strict=True
                ):
                    seen[index] = value
            abandon(item.wait)

    def _capture_combine(self, entry: _LayerGraphs, ring: int, dtype: torch.dtype) -> None:
        assert entry.plan is not None
        assert entry.wire_position is not None
        plan = entry.plan
        if self._reduced_replies:
            assert plan.token_row_offsets is not None
            segments, weights = plan.token_row_offsets, self._unit_weights[: plan.num_tokens]
        else:
            segments, weights = plan.segment_offsets, entry.topk_weights
        inputs = self._combine_inputs(ring, segments, entry.wire_position, weights, dtype)

        wait = self._wait_of(ring)
        bounds = self._bounds_of(ring) if self._bounds_in_combine(ring) else None
        copy = self._kernels.copy_words

        def body() -> torch.Tensor:
            if wait is not None:
                wait.launch()  # every expected reply, then at once the combine
            output = self._kernels.fused_combine(inputs)
            if bounds is not None:
                copy(bounds, plan.expert_bounds)  # what the deferred check reads
            return output

        try:
            entry.combine, entry.combine_out = self._captured("combine", entry, ring, body)
        except AFDError:
            entry.dispatch = None  # captured again, both, at the next use
            raise

    def _wait_of(self, ring: int) -> CombineWait | None:
        """The wait of ``ring``'s combine graphs, made (and its kernel loaded) on first use;
        None without a combine wait."""
        wait = self._waits.get(ring)
        if wait is None and self._combine_wait is not None:
            wait = self._combine_wait(self._transport)
            if wait is not None:
                wait.prepare()
                self._waits[ring] = wait
        return wait

    def _bounds_in_combine(self, ring: int) -> bool:
        """Whether ``ring``'s combine graph reads the expert-id range back (deferred, with a
        wait in it: checked later, per ring) rather than its dispatch graph (checked as
        soon as the combine has its replies)."""
        return self._defer and self._wait_of(ring) is not None

    def _bounds_of(self, ring: int) -> torch.Tensor:
        """``ring``'s deferred bounds readback buffer (made on first use)."""
        bounds = self._ring_bounds.get(ring)
        if bounds is None:
            on_gpu = self.device.type == "cuda"
            bounds = torch.zeros(2, dtype=torch.int64, pin_memory=on_gpu)
            self._ring_bounds[ring] = bounds
        return bounds

    def _captured(
        self, what: str, entry: _LayerGraphs, ring: int, body: Callable[[], _T]
    ) -> tuple[Replay, _T]:
        """``self._capture(body)``, counted and timed; a failure is an :class:`AFDError`."""
        started = time.perf_counter()
        try:
            captured = self._capture(body)
        except Exception as exc:
            raise AFDError(
                f"capturing the {what} of {entry.hidden.shape[0]} tokens (ring {ring}) as a "
                f"CUDA graph failed: {exc}; use the eager kernel endpoint (no graphs)"
            ) from exc
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        return captured
