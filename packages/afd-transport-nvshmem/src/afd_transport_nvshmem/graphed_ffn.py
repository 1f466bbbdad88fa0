"""An FFN rank's serve loop replayed from one CUDA graph (the FFN side of issue #27).

Eagerly, serving one work item costs the host a device-wait slice or several (a graph
replay and a request upload each), a header decode, a group list copy, the expert
launches and a reply of copies, a header upload and a flag store: about a millisecond
per MoE layer under MPS, most of it host time on the critical path of every layer.
:class:`GraphedFFNServer` moves the whole step to the device
(:mod:`afd_transport_nvshmem.serve_kernels`): a graph of ``steps_per_graph`` serve steps,
each of which waits on the device for any ready (replica, layer, stage) item, checks its
header, lays out its rows, runs the caller's *expert step* on them and writes the reply
and its flag into the source attention rank's window -- the layer, the counts and the
source never leave the device. This is seed 002's graph FFN mode (a fixed number of
iterations, fixed-shape buffers sized by the capacities, one capture serving every layer)
for NVIDIA GPUs.

The host only replays the graph (two replays in flight, so the device never waits for
the host) and reads, in order, the *record* each step writes into page-locked memory:
what it served (for :class:`afd_protocol.ServeStats`), or why it served nothing -- its
poll budget was spent (idle), an attention rank shut down, aborted, or sent a header the
step refused. Liveness is what it is for the eager loop: every device wait is bounded by
a poll budget, between which the host checks that the attention ranks are alive
(:meth:`~afd_protocol.window.WindowTransport.check_alive`), so a killed peer is a named
error within the timeout; an abort word or a bad header ends the loop on the device at
once (the steps still queued find the device's *halt* word set), and the host stops it with
a stop word in page-locked memory that every wait reads.

The expert step is the caller's: ``step(rows [P, H], counts int64 [E_local], layer int32
[1]) -> out [P, H]`` with the rows grouped by local expert (``counts`` rows each, in order;
rows past their sum hold stale values and must not matter), ``layer`` the model layer
index, everything on the transport's device and nothing read to the host, so that a graph
can hold it (the ``triton`` expert backend's layer-select grouped GEMM is such a step:
``afd_models.FFNRoleExecutor.device_expert_step``; an identity ``lambda rows, counts,
layer: rows`` serves a benchmark). ``P`` is the most partials one item can have.

Supported layouts: one attention rank per DP replica (an item is one slot), shared experts
on the attention side (nothing but routed rows arrives), and every wire format
(``per_choice``; ``per_rank`` reduced on either side). The outputs equal the eager
window FFN endpoint's with the same expert step bitwise (float32; tested on the CPU under
Triton's interpreter with :func:`~afd_transport_nvshmem.graphed_attention.replayed_calls`
standing in for the graph, and on the GPU with real graphs).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from afd_protocol import (
    FLAG_ROWS_PER_TOKEN,
    FLAG_SHUTDOWN,
    HEADER_FIXED_WORDS,
    KNOWN_FLAGS,
    MAGIC,
    PROTOCOL_VERSION,
    CombineReduce,
    EndpointOptions,
    InvalidArgument,
    ItemRecord,
    MessageKind,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    ServeStats,
    SharedPlacement,
    crc_columns,
    decode_header,
    torch_dtype,
)
from afd_protocol.window import WindowOptions, WindowTransport, abort_words, flag_words
from afd_transport_nvshmem import serve_kernels as kernels
from afd_transport_nvshmem.device_wait import pause_ns
from afd_transport_nvshmem.graphed_attention import CudaGraphCapture, GraphCapture, Replay

ExpertStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``step(rows [P, H], counts int64 [E_local], layer int32 [1]) -> out [P, H]`` (module
docstring): capturable, no host read, the output in the rows' dtype."""

WhileIdle = Literal["raise", "wait", "return"]
POLL_SLICE = 20000
"""Device polls per wait (about 10-20 ms on an H200); between them the host checks peers."""
SUSPECT_GRACE = 2.0
"""Seconds a liveness failure may go unconfirmed by an idle slice before it is raised (time
for the device to take what the dead rank sent last: its shutdown, behind one step)."""
DRAIN_LIMIT = 5.0
"""Seconds the replays in flight get to stop once the host set the stop word."""
GATHER_ROWS = 8
EXPAND_ROWS = 256
BLOCK_H = 1024


@dataclass(frozen=True)
class ServeGraphOptions:
    """How a :class:`GraphedFFNServer` is built; fixed at construction."""

    steps_per_graph: int = 4
    """Serve steps per graph replay (the host replays once per this many items or idle
    slices; two replays are in flight)."""
    poll_slice: int = POLL_SLICE
    """Device polls per wait before the step gives up (an idle record)."""
    served_layers: tuple[int, ...] | None = None
    """The model layers this rank serves (None: any below ``num_layers``); an item of
    another layer is refused, naming it. Needs ``num_layers`` in the endpoint options."""
    liveness_interval: float = 0.05
    """Seconds between the host's checks that the attention ranks are alive."""

    def __post_init__(self) -> None:
        if self.steps_per_graph < 1:
            raise InvalidArgument(
                f"steps_per_graph must be >= 1 (serve steps per graph), got {self.steps_per_graph}"
            )
        if self.poll_slice < 1:
            raise InvalidArgument(f"poll_slice must be >= 1, got {self.poll_slice}")
        if self.liveness_interval <= 0:
            raise InvalidArgument(
                f"liveness_interval must be > 0 seconds, got {self.liveness_interval}"
            )


_ABANDONED: list[object] = []
"""Buffers of servers whose graph may still run after they gave up on it (see ``_drain``)."""


class GraphedFFNServer:
    """Serves this FFN rank's work items by replaying a graph of device serve steps.

    ``transport``: this FFN rank's window transport (windows on a GPU; on the CPU only
    under Triton's interpreter, for tests); ``step``: the expert step (module docstring);
    ``options``: the endpoint options (``timeout``, ``num_layers``, ``num_stages``);
    ``graph``: :class:`ServeGraphOptions`; ``capture``: how the graph is made (default
    :class:`~afd_transport_nvshmem.graphed_attention.CudaGraphCapture`). Binds the window
    like an endpoint: close it before opening another.
    """

    def __init__(
        self,
        transport: WindowTransport,
        step: ExpertStep,
        options: EndpointOptions | None = None,
        graph: ServeGraphOptions | None = None,
        capture: GraphCapture | None = None,
    ) -> None:
        if getattr(transport, "data_path", "mapped") != "mapped":
            raise InvalidArgument(
                "the graph-replayed FFN loop stores replies straight into the attention "
                "ranks' windows, which the put path does not map; serve eagerly (no serve "
                "graph) or open the transport with NvshmemOptions(data_path='mapped')"
            )
        self.options = WindowOptions.of(options)
        self.graph_options = graph or ServeGraphOptions()
        self._transport = transport
        self._window = transport.window
        self._slot = slot = self._window.slot
        self._topology = topo = slot.topology
        self.rank = transport.rank
        self._check_layout()
        self._step = step
        self.device = transport.device
        self.dtype = torch_dtype(slot.dtype)
        self._num_attention = topo.num_attention_ranks
        self._ring_depth = self._window.ring_depth
        self._num_slots = self._num_attention * self._ring_depth
        self._num_counts = slot.num_local_experts(self.rank)
        self._per_rank = slot.per_rank
        self._reduce = slot.per_rank and slot.combine_reduce is CombineReduce.FFN
        self._partials_cap = (
            slot.token_cap * min(slot.topk, self._num_counts) if slot.per_rank else slot.routed_cap
        )
        self._header_words = HEADER_FIXED_WORDS + self._num_counts
        self._record_words = 16 * -(-(kernels.RECORD_FIXED + self._header_words) // 16)
        self._num_records = 2 * self.graph_options.steps_per_graph
        self._slot_block = kernels.next_power(self._num_slots)
        self._rank_block = kernels.next_power(self._num_attention)
        self._served_layers = self._served_table()
        self._build_buffers()
        self._stream = (
            torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            if self.device.type == "cuda"
            else None
        )
        self._capture: GraphCapture = capture or CudaGraphCapture(self.device)
        self._replay: Replay | None = None
        self._kept: Any = None
        self._in_flight = 0
        self._cursor = 0
        """The record the host reads next (the device's step count, less what is unread)."""
        self._finished: set[int] = set()
        """Attention ranks whose shutdown a step consumed."""
        self._closed = False
        self.capture_seconds = 0.0
        """Host time spent compiling, warming up and capturing the serve graph."""
        self.replays = 0
        """Graph replays enqueued so far."""
        started = time.perf_counter()
        self._prepare()
        self.capture_seconds = time.perf_counter() - started
        transport.bind(self)

    # ---- what an FFN endpoint tells the executor -------------------------------------------

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Global ids of this rank's routed experts, by local id."""
        return self._topology.local_experts(self.rank)

    @property
    def shared_placement(self) -> SharedPlacement:
        return self._slot.shared_placement

    @property
    def partials_capacity(self) -> int:
        """``P``: rows of the expert step's input (the most partials of one item)."""
        return self._partials_cap

    # ---- set-up ----------------------------------------------------------------------------

    def _check_layout(self) -> None:
        topo, slot = self._topology, self._slot
        if topo.attn_ranks_per_dp != 1:
            raise InvalidArgument(
                f"the graphed FFN loop takes one slot per work item, so it needs one attention "
                f"rank per DP replica; this topology has attn_ranks_per_dp="
                f"{topo.attn_ranks_per_dp}: use the eager FFN endpoint"
            )
        if slot.shared_cap:
            raise InvalidArgument(
                "the graphed FFN loop serves routed experts only; shared_placement='ffn' sends "
                "shared rows to the FFN ranks: use shared_placement='attention' (or the eager "
                "FFN endpoint)"
            )
        served = self.graph_options.served_layers
        if served is not None:
            layers = self.options.num_layers
            if layers is None:
                raise InvalidArgument(
                    "served_layers needs num_layers in the endpoint options (the layer table's "
                    "size)"
                )
            outside = [layer for layer in served if not 0 <= layer < layers]
            if outside or not served:
                raise InvalidArgument(
                    f"served_layers must be a non-empty list of layers in [0, {layers}); got "
                    f"{list(served)}"
                )

    def _served_table(self) -> torch.Tensor:
        served = self.graph_options.served_layers
        layers = self.options.num_layers or 1
        table = torch.ones(layers, dtype=torch.int32)
        if served is not None:
            table.zero_()
            table[list(served)] = 1
        return table.to(self.device)

    def _build_buffers(self) -> None:
        device, slot, window = self.device, self._slot, self._window
        transport = self._transport
        local = transport.local_window()
        total = window.total_bytes
        itemsize = self.dtype.itemsize
        self._words = local[: total // 4 * 4].view(torch.int32)
        self._floats = local[: total // 4 * 4].view(torch.float32)
        self._rows_view = local[: total // itemsize * itemsize].view(self.dtype)
        self._flags = flag_words(local, window)
        self._aborts = abort_words(local, window)
        state = torch.zeros(self._slot_block + kernels.S_FIRST_RANK + self._rank_block)
        state = state.to(torch.int32)
        for index in range(self._num_slots):
            state[index] = transport.seen[index]
        state[self._slot_block + kernels.S_SEQ] = transport.sequence.last
        self._state = state.to(device)
        self._item = torch.zeros(kernels.ITEM_WORDS, dtype=torch.int32, device=device)
        self._counts = torch.zeros(self._num_counts, dtype=torch.int64, device=device)
        self._layer = torch.zeros(1, dtype=torch.int32, device=device)
        hidden = slot.hidden_size
        self._rows = torch.zeros(self._partials_cap, hidden, dtype=self.dtype, device=device)
        self._row_of_partial = torch.zeros(self._partials_cap, dtype=torch.int64, device=device)
        slots_of = slot.token_cap * slot.topk if slot.per_rank else 1
        self._partial_of_slot = torch.full((slots_of,), -1, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        records = torch.zeros(self._num_records * self._record_words, dtype=torch.int32)
        self._records = records.pin_memory() if pinned else records
        self._record_memory = (ctypes.c_int32 * self._records.numel()).from_address(
            self._records.data_ptr()
        )
        control = torch.zeros(2, dtype=torch.int32)
        self._control = control.pin_memory() if pinned else control
        self._control_memory = (ctypes.c_int32 * 2).from_address(self._control.data_ptr())
        base, columns = crc_columns(self._header_words)
        signed = [c - (1 << 32) if c >= 1 << 31 else c for c in columns]
        self._crc_columns = torch.tensor(signed, dtype=torch.int32, device=device)
        self._crc_base = base - (1 << 32) if base >= 1 << 31 else base
        peers = [transport.peer_window(a).data_ptr() for a in range(self._num_attention)]
        self._peer_windows = torch.tensor(peers, dtype=torch.int64, device=device)
        self._host_pointers = [_pointer(t, pinned) for t in (self._records, self._control)]
        self._programs = _programs(device)

    # ---- the serve step --------------------------------------------------------------------

    def _serve_step(self) -> torch.Tensor:
        """Enqueue one serve step (module docstring); returns the expert step's output."""
        slot, window = self._slot, self._window
        hidden = slot.hidden_size
        records, control = self._host_pointers
        itemsize = self.dtype.itemsize
        num_layers = self.options.num_layers
        num_stages = self.options.num_stages
        fixed_block = kernels.next_power(HEADER_FIXED_WORDS)
        count_block = kernels.next_power(self._num_counts)
        kernels._take_kernel[(1,)](
            self._flags,
            self._aborts,
            self._words,
            self._state,
            self._item,
            self._counts,
            self._layer,
            records,
            control,
            self._served_layers,
            self._crc_columns,
            self._crc_base,
            self._num_slots,
            self._ring_depth,
            self._num_attention,
            window.slots_offset // 4,
            slot.slot_bytes // 4,
            num_layers if num_layers is not None else kernels.SEQ_MAX,
            num_stages if num_stages is not None else kernels.SEQ_MAX,
            slot.token_cap,
            slot.routed_cap,
            slot.shared_cap,
            slot.topk,
            self.graph_options.poll_slice,
            self._num_records,
            SLOT_BLOCK=self._slot_block,
            RANK_BLOCK=self._rank_block,
            NUM_COUNTS=self._num_counts,
            COUNT_BLOCK=count_block,
            FIXED=HEADER_FIXED_WORDS,
            FIXED_BLOCK=fixed_block,
            RECORD_WORDS=self._record_words,
            ROWS_PER_TOKEN=slot.rows_per_token(MessageKind.DISPATCH),
            REDUCE=self._reduce,
            CHECK_SERVED=self.graph_options.served_layers is not None,
            MAGIC=MAGIC,
            VERSION=PROTOCOL_VERSION,
            KNOWN_FLAGS=KNOWN_FLAGS,
            FLAG_SHUTDOWN=FLAG_SHUTDOWN,
            FLAG_ROWS=FLAG_ROWS_PER_TOKEN,
            PAUSE_NS=pause_ns(self.device),
        )
        if self._per_rank:
            kernels._expand_kernel[(self._num_counts,)](
                self._words,
                self._item,
                self._counts,
                self._row_of_partial,
                self._partial_of_slot,
                window.slots_offset // 4,
                slot.slot_bytes // 4,
                slot.field("route_ids").offset // 4,
                self._partials_cap,
                NUM_COUNTS=self._num_counts,
                COUNT_BLOCK=count_block,
                TOPK=slot.topk,
                TOPK_BLOCK=kernels.next_power(slot.topk),
                ROWS=EXPAND_ROWS,
            )
        block = min(BLOCK_H, kernels.next_power(hidden))
        grid = (min(self._programs, -(-self._partials_cap // GATHER_ROWS)), -(-hidden // block))
        kernels._gather_rows_kernel[grid](
            self._rows_view,
            self._item,
            self._row_of_partial,
            self._rows,
            window.slots_offset // itemsize,
            slot.slot_bytes // itemsize,
            slot.field("routed_rows").offset // itemsize,
            hidden,
            EXPAND=self._per_rank,
            ROWS=GATHER_ROWS,
            BLOCK=block,
        )
        out = self._step(self._rows, self._counts, self._layer)
        kernels._reply_rows_kernel[grid](
            out,
            self._floats,
            self._item,
            self._partial_of_slot,
            self._peer_windows,
            window.field_offset(self.rank, 0, "routed_rows"),
            slot.slot_bytes,
            window.slots_offset // 4,
            slot.slot_bytes // 4,
            slot.field("route_weights").offset // 4,
            hidden,
            REDUCE=self._reduce,
            TOPK=slot.topk,
            ROWS=GATHER_ROWS,
            BLOCK=block,
        )
        kernels._reply_header_kernel[(1,)](
            self._words,
            self._item,
            self._state,
            records,
            self._peer_windows,
            window.field_offset(self.rank, 0, "header"),
            window.flag_offset(self.rank, 0),
            slot.slot_bytes,
            window.slots_offset // 4,
            slot.slot_bytes // 4,
            self._crc_columns,
            self._crc_base,
            self.rank,
            self._num_records,
            SLOT_BLOCK=self._slot_block,
            NUM_COUNTS=self._num_counts,
            COUNT_BLOCK=count_block,
            FIXED=HEADER_FIXED_WORDS,
            FIXED_BLOCK=fixed_block,
            RECORD_WORDS=self._record_words,
            REPLY_FLAGS=FLAG_ROWS_PER_TOKEN if self._reduce else 0,
            MAGIC=MAGIC,
            VERSION=PROTOCOL_VERSION,
        )
        return out

    def _steps(self) -> list[torch.Tensor]:
        return [self._serve_step() for _ in range(self.graph_options.steps_per_graph)]

    def _prepare(self) -> None:
        """Compile and load every kernel with a step that serves nothing (the device's halt
        word set), check the expert step's output, capture the graph (still halted: a
        stand-in capture may run the steps), then start from a fresh state."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        halt = self._slot_block + kernels.S_HALT
        cursor = self._slot_block + kernels.S_CURSOR
        with self._on_stream():
            self._state[halt : halt + 1].fill_(1)
            out = self._serve_step()
            expected = (self._partials_cap, self._slot.hidden_size)
            if tuple(out.shape) != expected or out.dtype != self.dtype or not out.is_contiguous():
                raise InvalidArgument(
                    f"the expert step must return a contiguous {self.dtype} tensor of shape "
                    f"{list(expected)} (one output row per input row); it returned "
                    f"{out.dtype} {list(out.shape)}"
                )
            self._replay, self._kept = self._capture(self._steps)
            # The halted steps wrote records and moved the cursor: back to the start.
            self._state[halt : halt + 1].zero_()
            self._state[cursor : cursor + 1].zero_()
        self._synchronize()
        self._records.zero_()

    def _on_stream(self) -> Any:
        if self._stream is None:
            import contextlib

            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    # ---- serving ---------------------------------------------------------------------------

    def serve(
        self,
        *,
        while_idle: WhileIdle = "raise",
        timeout: float | None = None,
        stats: ServeStats | None = None,
    ) -> ServeStats:
        """Serve work items until every attention rank shut down; returns ``stats`` (a new
        :class:`afd_protocol.ServeStats` when None), filled item by item.

        ``while_idle``: what a wait that saw nothing for ``timeout`` seconds (None: the
        options' timeout) does -- ``raise`` :class:`PeerTimeout`, ``wait`` on (a dead peer
        still ends the loop with :class:`PeerAborted`), or ``return`` the stats at the first
        idle wait (for step-by-step tests and drains). Raises :class:`PeerAborted` when a
        watched attention rank aborted or died, :class:`ProtocolError` naming the field of a
        refused header (the loop stops there, as the eager ``serve`` does). Returns at once
        once every attention rank has shut down.
        """
        self._check_open()
        if while_idle not in ("raise", "wait", "return"):
            raise InvalidArgument(
                f"while_idle must be 'raise', 'wait' or 'return', got {while_idle!r}"
            )
        stats = ServeStats() if stats is None else stats
        limit = self.options.timeout if timeout is None else timeout
        if self.finished:
            return stats
        loop = _Loop(self, stats, while_idle, limit)
        try:
            loop.run()
        except BaseException:
            loop.drain()
            raise
        if not loop.drain():
            raise PeerTimeout(
                f"FFN rank {self.rank}: the serve graph did not stop within {DRAIN_LIMIT:g} s "
                f"(a stalled GPU); this server serves no more"
            )
        return stats

    @property
    def finished(self) -> bool:
        """Every attention rank announced its shutdown (nothing more will be served)."""
        return len(self._finished) == self._num_attention

    def _enqueue(self) -> None:
        assert self._replay is not None
        with self._on_stream():
            self._replay()
        self._in_flight += 1
        self.replays += 1

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this GraphedFFNServer was closed")

    def close(self) -> None:
        """Release the window for another endpoint; drops the graph. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._replay = None
        self._kept = None
        self._transport.unbind(self)

    # ---- records ---------------------------------------------------------------------------

    def _record_word(self, index: int, word: int) -> int:
        return int(self._record_memory[(index % self._num_records) * self._record_words + word])

    def _take_record(self, index: int) -> list[int]:
        """Record ``index`` (mod the ring) as int32 words, cleared for its next use."""
        at = (index % self._num_records) * self._record_words
        words = list(self._record_memory[at : at + self._record_words])
        ctypes.memset(ctypes.addressof(self._record_memory) + 4 * at, 0, 4 * self._record_words)
        return words

    def _refused(self, words: list[int]) -> ProtocolError:
        """The error of a record whose header the device refused."""
        src, ring = words[kernels.R_SRC], words[kernels.R_RING]
        where = f"FFN rank {self.rank}: slot from attention rank {src} (ring {ring})"
        start = kernels.RECORD_FIXED
        header = words[start : start + self._header_words]
        limits = self._slot.header_limits(
            MessageKind.DISPATCH,
            self.rank,
            num_layers=self.options.num_layers,
            num_stages=self.options.num_stages,
        )
        try:
            decoded = decode_header(header, limits)
        except ProtocolError as exc:
            return ProtocolError(f"{where}: {exc}")
        if words[kernels.R_PROBLEM] == kernels.PROBLEM_LAYER:
            served = list(self.graph_options.served_layers or ())
            return ProtocolError(
                f"{where}: layer {decoded.layer} is not one this FFN rank serves ({served}); "
                f"both roles must use one model config"
            )
        return ProtocolError(
            f"{where} is inconsistent: KIND={decoded.kind.name}, SRC_RANK={decoded.src_rank}, "
            f"SEQ={decoded.seq} (flag {words[kernels.R_FLAG]})"
        )


class _Loop:
    """One :meth:`GraphedFFNServer.serve` call: replays in flight, records read in order
    (the record at ``server._cursor`` is the next one the graph completes)."""

    def __init__(
        self, server: GraphedFFNServer, stats: ServeStats, while_idle: WhileIdle, limit: float
    ) -> None:
        self.server = server
        self.stats = stats
        self.while_idle = while_idle
        self.limit = limit
        self.last_activity = time.monotonic()
        self.next_liveness = self.last_activity + server.graph_options.liveness_interval
        self.suspect: tuple[PeerAborted, float] | None = None
        """A liveness failure not yet confirmed, and when it was first seen."""

    def run(self) -> None:
        server = self.server
        while server._in_flight < 2:
            server._enqueue()
        while True:
            words, taken, replied = self._next(time.monotonic() + self.limit)
            # Past the record before acting on it: an error it raises leaves the cursor on
            # the next record, which is what the drain reads.
            replay_done = self._advance()
            done = self._handle(words, taken, replied)
            if replay_done and not done:
                server._enqueue()
            if done:
                return

    def _advance(self) -> bool:
        """Move past the record just read; True when that completed a replay."""
        server = self.server
        server._cursor += 1
        if server._cursor % server.graph_options.steps_per_graph:
            return False
        server._in_flight -= 1
        return True

    def _record_item(self, words: list[int], taken: float, replied: float) -> None:
        server = self.server
        src = words[kernels.R_SRC]
        self.stats.items.append(
            ItemRecord(
                replica=server._topology.dp_replica_of(src),
                layer=words[kernels.R_LAYER],
                stage=words[kernels.R_STAGE],
                routed_rows=words[kernels.R_REPLY_ROWS],
                shared_rows=0,
                src_ranks=(src,),
                taken=taken,
                computed=replied,
                replied=replied,
            )
        )
        self.last_activity = replied

    def _handle(self, words: list[int], taken: float, replied: float) -> bool:
        """Act on one record; True when this serve call is over."""
        server = self.server
        code = words[kernels.R_CODE]
        if code == kernels.CODE_ITEM:
            if words[kernels.R_DONE] == 2:
                raise ProtocolError(
                    f"FFN rank {server.rank}: slot from attention rank {words[kernels.R_SRC]} "
                    f"(ring {words[kernels.R_RING]}): its route_ids disagree with the header's "
                    f"EXPERT_COUNTS (a token routed twice to one expert, an id out of range, "
                    f"or counts that do not match)"
                )
            self._record_item(words, taken, replied)
            return False
        if code == kernels.CODE_IDLE:
            if self.suspect is not None:
                raise self.suspect[0]
            if self.while_idle == "return":
                return True
            if self.while_idle == "raise" and time.monotonic() - self.last_activity > self.limit:
                raise PeerTimeout(
                    f"FFN rank {server.rank}: no work item became ready within {self.limit:g} s"
                )
            return False
        if code == kernels.CODE_SHUTDOWN:
            server._finished.add(words[kernels.R_SRC])
            self.suspect = None  # checked again, without the rank that finished
            return server.finished
        if code == kernels.CODE_ABORTED:
            aborts = server._aborts.tolist()[: server._num_attention]
            raise PeerAborted(
                f"FFN rank {server.rank}: attention rank(s) "
                f"{[a for a, w in enumerate(aborts) if w]} aborted (see their own error for "
                f"the cause)"
            )
        if code == kernels.CODE_BAD_HEADER:
            raise server._refused(words)
        if code == kernels.CODE_HALTED and server.finished:
            return True
        raise ProtocolError(
            f"FFN rank {server.rank}: the serve graph wrote record code {code} "
            f"(halted: {code == kernels.CODE_HALTED}) with attention ranks "
            f"{sorted(set(range(server._num_attention)) - server._finished)} still running"
        )

    def _next(self, deadline: float) -> tuple[list[int], float, float]:
        """Wait for the record at the cursor to be complete; ``(words, taken, done)`` with
        the host's clock when its code and its done word were first seen."""
        server = self.server
        index = server._cursor
        taken = 0.0
        interval = server.graph_options.liveness_interval
        peers = [a for a in range(server._num_attention) if a not in server._finished]
        while True:
            # The peers first, also when records are ready as fast as they are read.
            now = time.monotonic()
            if now >= self.next_liveness:
                self._check_alive(peers)
                self.next_liveness = now + interval
            if taken == 0.0 and server._record_word(index, kernels.R_CODE) != 0:
                taken = time.monotonic()
            if server._record_word(index, kernels.R_DONE) != 0:
                replied = time.monotonic()
                return server._take_record(index), taken or replied, replied
            if now > deadline:
                raise PeerTimeout(
                    f"FFN rank {server.rank}: the serve graph wrote no record in "
                    f"{self.limit:g} s (a stalled GPU, or an expert step slower than the timeout)"
                )

    def _check_alive(self, peers: list[int]) -> None:
        """Note a dead attention rank rather than raise at once: it may have published its
        shutdown and exited before the device took it. The next idle record (a whole poll
        slice with nothing new) confirms it, or :data:`SUSPECT_GRACE` seconds of it (the
        device may make no progress at all meanwhile)."""
        try:
            self.server._transport.check_alive(peers)
        except PeerAborted as exc:
            if self.suspect is None:
                self.suspect = (exc, time.monotonic())
            elif time.monotonic() - self.suspect[1] > min(SUSPECT_GRACE, self.limit):
                raise self.suspect[0] from None
        else:
            self.suspect = None

    def drain(self) -> bool:
        """Stop the device loop (the stop word in page-locked memory), read the records of
        the replays still in flight -- an item served meanwhile is recorded -- and hand the
        sequence numbers and the flags last seen back to the transport. A graph that does not
        stop within :data:`DRAIN_LIMIT` is abandoned: its buffers are kept for the process's
        life, and the server serves no more."""
        server = self.server
        server._control_memory[0] = 1
        deadline = time.monotonic() + DRAIN_LIMIT
        try:
            while server._in_flight:
                index = server._cursor
                while server._record_word(index, kernels.R_DONE) == 0:
                    if time.monotonic() > deadline:
                        _ABANDONED.append(server.__dict__.copy())
                        server._in_flight = 0
                        server._closed = True  # the window stays bound: nothing else uses it
                        return False
                now = time.monotonic()
                words = server._take_record(index)
                code = words[kernels.R_CODE]
                if code == kernels.CODE_ITEM and words[kernels.R_DONE] == 1:
                    self._record_item(words, now, now)
                elif code == kernels.CODE_SHUTDOWN:
                    server._finished.add(words[kernels.R_SRC])
                self._advance()
        finally:
            server._control_memory[0] = 0
        server._synchronize()
        state = server._state.tolist()
        for index in range(server._num_slots):
            server._transport.seen[index] = int(state[index])
        server._transport.sequence.last = int(state[server._slot_block + kernels.S_SEQ])
        return True


def _pointer(tensor: torch.Tensor, pinned: bool) -> Any:
    """A kernel argument for page-locked host memory (its address), or the tensor itself on
    the CPU (the interpreter)."""
    if not pinned:
        return tensor
    from afd_transport_nvshmem.device_wait import HostPointer

    return HostPointer(tensor)


def _programs(device: torch.device) -> int:
    """Programs of the persistent row kernels: four per multiprocessor (two on the CPU)."""
    if device.type != "cuda":
        return 2
    return 4 * int(torch.cuda.get_device_properties(device).multi_processor_count)


__all__: Sequence[str] = ["ExpertStep", "GraphedFFNServer", "ServeGraphOptions"]
