# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Device-side waits written in Triton.

``wait_any`` runs one small program that polls the watched flag words of this rank's
window with acquire loads at system scope and, as soon as one differs from the value last
seen (or a watched peer's abort word is set, or its poll budget is spent), writes the
flag values -- and the header of every slot whose flag changed -- into *pinned host
memory*, then a status word with a release store. The host spins on that host memory: no
``cudaMemcpy`` and no stream synchronisation per check (which is what makes a host-polled
wait cost a device-to-host round trip each time), and when it learns that a message
arrived it already holds the message's header: layer, stage, row counts and sequence
numbers cost no further copy.

The header words are read after the flag's acquire load (a CTA barrier orders every
thread's flag load before any thread's header load), so they are the ones the sender wrote
before publishing; a sender does not touch the slot again before it gets an answer, so
they cannot be torn. (The one exception is a shutdown announcement, which an FFN rank may
write into ring 0 while a reply there is unread; the attention rank then sees a shutdown
or a checksum error, never a wrong answer.)

With ``ALL`` set, the program waits instead until *every* watched flag differs from its
value last seen: :class:`WaitBlock` launches it that way inside the graph of a combine
(:mod:`afd_transport_nvshmem.graphed_attention`), so the combine kernel behind it starts the
moment the last reply lands, with no host in between.

``pingpong`` is a persistent kernel for the latency benchmark: it bounces a flag between
two GPUs N times without the host.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from afd_protocol import WindowLayout
from afd_transport_nvshmem.combine_wait import MAX_DEADLINE_US

STATUS_CHANGED = 1
STATUS_SLICE_OVER = 2
"""The poll budget, or the deadline, ran out first."""
STATUS_ABORTED = 3
STATUS_CANCELLED = 4
"""The host cancelled the wait (:meth:`WaitBlock.cancel`) while it ran."""


POLL_PAUSE_NS = 256
"""Nanoseconds a device wait sleeps between two polls that saw nothing (``nanosleep``): a
spinning poll loop otherwise competes with the kernels of a rank sharing the GPU (or the
SMs) for issue slots and the memory system, for a few hundred nanoseconds of latency at
most. 0 on the CPU (Triton's interpreter runs no inline assembly)."""


def pause_ns(device: torch.device) -> int:
    """:data:`POLL_PAUSE_NS` on a CUDA device, 0 elsewhere."""
    return POLL_PAUSE_NS if device.type == "cuda" else 0


@triton.jit
def pause(nanoseconds):
    """Sleep this thread for about ``nanoseconds`` (PTX ``nanosleep``, sm_70 and later)."""
    return tl.inline_asm_elementwise(
        "nanosleep.u32 $1; mov.u32 $0, 0;",
        "=r,r",
        [nanoseconds],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def poll_flags(flags, where, mask, seen, aborts, peers, peer_mask):
    """One poll of the flag words at ``flags + where`` (``mask``: the lanes watched) and the
    abort words at ``aborts + peers``, with acquire loads at system scope: ``(current,
    changed, aborted)`` -- the values (``seen`` where unwatched), how many differ from
    ``seen``, how many watched abort words are set."""
    loaded = tl.atomic_add(flags + where, 0, mask=mask, sem="acquire", scope="sys")
    current = tl.where(mask, loaded, seen)
    changed = tl.sum(tl.where(mask & (current != seen), 1, 0), axis=0)
    abort = tl.atomic_add(aborts + peers, 0, mask=peer_mask, sem="acquire", scope="sys")
    aborted = tl.sum(tl.where(peer_mask & (abort != 0), 1, 0), axis=0)
    return current, changed, aborted


REQUEST_FIXED = 6
"""Request block words before the lists: watched count, peer count, poll budget, deadline
in microseconds (0: none), cancel word, spare."""
CANCEL_WORD = 4


@triton.jit
def _elapsed_ns(start, TIMED: tl.constexpr):
    """Nanoseconds since ``start`` on the GPU's global timer (0 without ``TIMED``: Triton's
    interpreter runs no inline assembly)."""
    if TIMED:
        return globaltimer() - start
    return start * 0


@triton.jit
def _now_ns(TIMED: tl.constexpr):
    if TIMED:
        return globaltimer()
    return tl.full([], 0, tl.int64)


@triton.jit
def _wait_any_kernel(
    flags,
    aborts,
    request,
    out,
    window_words,
    header_offsets,
    headers_out,
    HEADER_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    PEER_BLOCK: tl.constexpr,
    WORD_BLOCK: tl.constexpr,
    ALL: tl.constexpr,
    PAUSE_NS: tl.constexpr,
    TIMED: tl.constexpr,
):
    # The request lives in pinned host memory, written by the host before the launch:
    # [n, n_peers, max_polls, deadline_us, cancel, 0, indices[BLOCK], last_seen[BLOCK],
    # peers[PEER_BLOCK]]; the cancel word may be set while the wait runs.
    n = tl.load(request, volatile=True)
    n_peers = tl.load(request + 1, volatile=True)
    max_polls = tl.load(request + 2, volatile=True)
    deadline_ns = tl.load(request + 3, volatile=True).to(tl.int64) * 1000
    start = _now_ns(TIMED)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    where = tl.load(request + 6 + offs, mask=mask, other=0, volatile=True)
    seen = tl.load(request + 6 + BLOCK + offs, mask=mask, other=0, volatile=True)
    poffs = tl.arange(0, PEER_BLOCK)
    pmask = poffs < n_peers
    pwhere = tl.load(request + 6 + 2 * BLOCK + poffs, mask=pmask, other=0, volatile=True)
    status = 0
    polls = 0
    current = seen
    while status == 0:
        current, changed, aborted = poll_flags(flags, where, mask, seen, aborts, pwhere, pmask)
        polls += 1
        done = changed == n if ALL else changed > 0
        late = (deadline_ns > 0) & (_elapsed_ns(start, TIMED) > deadline_ns)
        over = (polls >= max_polls) | late
        # The cancel word is host memory: read it every 16th poll (a bus round trip each).
        cancel = tl.load(request + 4, mask=(polls % 16) == 1, other=0, volatile=True)
        cancelled = cancel != 0
        status = tl.where(
            done,
            1,
            tl.where(aborted > 0, 3, tl.where(cancelled, 4, tl.where(over, 2, 0))),
        )
        if PAUSE_NS > 0:
            pause(tl.full([], PAUSE_NS, tl.int32))
    # Every thread's acquire load is done before any thread reads a header (and the status
    # is uniform: it comes from reductions), ...
    tl.debug_barrier()
    tl.store(out + offs, current, mask=mask)
    if status == 1:
        arrived = mask & (current != seen)
        base = tl.load(header_offsets + where, mask=arrived, other=0)
        for w0 in range(0, HEADER_WORDS, WORD_BLOCK):
            words = w0 + tl.arange(0, WORD_BLOCK)
            take = arrived[:, None] & (words < HEADER_WORDS)[None, :]
            tile = tl.load(window_words + base[:, None] + words[None, :], mask=take, volatile=True)
            tl.store(headers_out + offs[:, None] * HEADER_WORDS + words[None, :], tile, mask=take)
    # ... and every thread's stores of values and headers are done before the one thread
    # that publishes the status releases them to the host.
    tl.debug_barrier()
    tl.atomic_xchg(out + BLOCK, status, sem="release", scope="sys")


class HostPointer:
    """Lets Triton take pinned host memory as a pointer argument (UVA: same address)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return int(self._tensor.data_ptr())


class DeviceWaiter:
    """Reusable state for device-side ``wait_any`` calls of one transport: a
    :class:`WaitBlock` that ends at the *first* change, launched on a stream of its own.

    ``window_words`` is the local window as int32 words and ``header_offsets[i]`` the word
    offset of flag ``i``'s slot header in it; ``header_words`` words are captured per
    arrived slot. ``max_peers`` bounds the watched abort words.

    Everything that changes between waits (which flags, the values last seen, which peers,
    the poll budget) goes to the kernel through the block's pinned *request*, so the
    kernel's arguments never change: the launch is captured once into a CUDA graph and each
    wait is one graph replay -- no Triton launch path and no host-to-device copy per wait (a
    copy from pageable memory would make the host wait for the device).
    """

    def __init__(
        self,
        flags: torch.Tensor,
        aborts: torch.Tensor,
        window_words: torch.Tensor,
        header_offsets: torch.Tensor,
        header_words: int,
        max_peers: int,
        use_graph: bool = True,
    ) -> None:
        self.block = WaitBlock(
            flags, aborts, window_words, header_offsets, header_words, max_peers, all_flags=False
        )
        self.stream = torch.cuda.Stream(device=flags.device)  # type: ignore[no-untyped-call]
        self.graph: torch.cuda.CUDAGraph | None = None
        # A graph cannot capture Triton's first-launch compilation: run once first.
        self.block.prepare()
        if use_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.block.launch()
            self.graph = graph

    def launch(
        self, indices: tuple[int, ...], last: tuple[int, ...], peers: tuple[int, ...], polls: int
    ) -> None:
        """Start one poll slice; then read :meth:`status` until it is non-zero."""
        self.block.write(indices, last, peers, polls)
        with torch.cuda.stream(self.stream):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.block.launch()

    def status(self) -> int:
        return self.block.status()

    def values(self, n: int) -> list[int]:
        return self.block.values(n)

    def header(self, position: int) -> torch.Tensor:
        """A host copy of the header captured for watched position ``position``."""
        return self.block.header(position)


def header_offsets(window: WindowLayout, device: torch.device) -> torch.Tensor:
    """int64 ``[regions * ring_depth]`` on ``device``: the int32-word offset of every slot's
    header in a window (by flag index), what the wait kernel reads headers at."""
    at = window.slot.field("header").offset
    offsets = [
        (window.slot_offset(*divmod(i, window.ring_depth)) + at) // 4
        for i in range(window.num_regions * window.ring_depth)
    ]
    return torch.tensor(offsets, dtype=torch.int64, device=device)


class WaitBlock:
    """A bounded device wait for *every* one of a set of this window's flags (with
    ``all_flags=False``: for the first change, as :class:`DeviceWaiter` waits), that a CUDA
    graph can hold (the combine's: :mod:`afd_transport_nvshmem.graphed_attention`).

    :meth:`write` puts the next wait's flags, their values last seen, the peers whose abort
    words to watch and the poll budget into a request block; :meth:`launch` enqueues the
    wait kernel on the current stream, reading the request *when it runs*, so a graph
    replays it with whatever was last written. When it ends it has written the flag
    values, the header of every slot whose flag changed, and the status (1: all arrived, or
    one did, 2: the poll budget was spent, 3: a watched peer aborted) to host memory, which
    :meth:`status`, :meth:`values` and :meth:`header` read. ``flags``, ``aborts`` and
    ``window_words`` are the local window's (on a CUDA device, or on the CPU under Triton's
    interpreter); the request and results are page-locked on a GPU.
    """

    def __init__(
        self,
        flags: torch.Tensor,
        aborts: torch.Tensor,
        window_words: torch.Tensor,
        offsets: torch.Tensor,
        header_words: int,
        max_peers: int,
        all_flags: bool = True,
    ) -> None:
        self._device = flags.device
        on_gpu = flags.device.type == "cuda"
        self.block = triton.next_power_of_2(max(1, offsets.numel()))
        self.peer_block = triton.next_power_of_2(max(1, max_peers))
        words = REQUEST_FIXED + 2 * self.block + self.peer_block
        self.request = torch.zeros(words, dtype=torch.int32, pin_memory=on_gpu)
        self.out = torch.zeros(self.block + 1, dtype=torch.int32, pin_memory=on_gpu)
        self.headers = torch.zeros(self.block, header_words, dtype=torch.int32, pin_memory=on_gpu)
        self._request = (ctypes.c_int32 * words).from_address(self.request.data_ptr())
        self._out = (ctypes.c_int32 * (self.block + 1)).from_address(self.out.data_ptr())

        def pointer(t: torch.Tensor) -> torch.Tensor | HostPointer:
            return HostPointer(t) if on_gpu else t

        self._args = (
            flags,
            aborts,
            pointer(self.request),
            pointer(self.out),
            window_words,
            offsets,
            pointer(self.headers),
        )
        self._meta = {
            "HEADER_WORDS": header_words,
            "BLOCK": self.block,
            "PEER_BLOCK": self.peer_block,
            "WORD_BLOCK": min(128, triton.next_power_of_2(header_words)),
            "ALL": all_flags,
            "PAUSE_NS": pause_ns(flags.device),
            "TIMED": on_gpu,
        }

    def write(
        self,
        indices: Sequence[int],
        last: Sequence[int],
        peers: Sequence[int],
        polls: int,
        deadline_us: int = 0,
    ) -> None:
        """The next launch's wait; clears the status and the cancel word (call only once the
        last launch ended). It ends after ``polls`` polls, or -- on a GPU, when
        ``deadline_us`` > 0 -- that many microseconds after it started, whichever is first
        (Triton's interpreter has no clock: only the poll budget bounds it there)."""
        if not 0 <= deadline_us <= MAX_DEADLINE_US:
            raise ValueError(
                f"a device wait's deadline is 0..{MAX_DEADLINE_US} us, got {deadline_us}"
            )
        b = self.block
        request = [len(indices), len(peers), polls, deadline_us, 0, 0]
        request += list(indices) + [0] * (b - len(indices))
        request += list(last) + [0] * (b - len(last))
        request += list(peers) + [0] * (self.peer_block - len(peers))
        self._request[:] = request
        self._out[b] = 0

    def launch(self) -> None:
        """Enqueue the wait on the current stream (capturable)."""
        _wait_any_kernel[(1,)](*self._args, **self._meta)

    def cancel(self) -> None:
        """Ask a running wait to end now (status :data:`STATUS_CANCELLED`, within 16 polls);
        the next :meth:`write` clears the request."""
        self._request[CANCEL_WORD] = 1

    def prepare(self) -> None:
        """Compile and load the kernel (a wait for nothing, one poll) before any capture."""
        self.write((), (), (), 1)
        self.launch()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def status(self) -> int:
        """0 while the wait runs, then 1 (all arrived), 2 (budget or deadline spent), 3
        (a watched peer aborted) or 4 (cancelled)."""
        return int(self._out[self.block])

    def values(self, n: int) -> list[int]:
        """The first ``n`` watched flags' values, as the wait last saw them."""
        return list(self._out[:n])

    def header(self, position: int) -> torch.Tensor:
        """A host copy of the header captured for watched position ``position``."""
        return self.headers[position].clone()


@triton.jit
def _pingpong_kernel(local_flag, peer_flag, iterations, INITIATOR: tl.constexpr):
    i = 1
    while i <= iterations:
        if INITIATOR:
            tl.atomic_xchg(peer_flag, i, sem="release", scope="sys")
        value = tl.atomic_add(local_flag, 0, sem="acquire", scope="sys")
        while value < i:
            value = tl.atomic_add(local_flag, 0, sem="acquire", scope="sys")
        if not INITIATOR:
            tl.atomic_xchg(peer_flag, i, sem="release", scope="sys")
        i += 1


def pingpong(
    local_flag: torch.Tensor, peer_flag: torch.Tensor, iterations: int, initiator: bool
) -> None:
    """Enqueue the persistent ping-pong kernel on the current stream (one program)."""
    _pingpong_kernel[(1,)](local_flag, peer_flag, iterations, INITIATOR=initiator)
