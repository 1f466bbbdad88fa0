# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The put path: slots composed in local staging, then sent with NVSHMEM device puts
(``NvshmemOptions(data_path="put")``), for GPUs whose peers' memory is not mapped.

On the mapped path a sender writes rows straight into a peer's window through
``nvshmem_ptr``. Between nodes that pointer is NULL, and NVSHMEM moves bytes only by puts.
So with ``data_path="put"`` :meth:`NvshmemTransport.peer_window` hands the endpoints a
*staging* window instead -- this rank's own symmetric memory, one window per peer, laid
out like the peer's -- and every publish of a slot runs, on the current stream:

1. ``_put_extents_kernel``, grid ``(destinations, CHUNKS)``: each program reads the slot's
   header from staging (written earlier on the stream), derives the bytes each field uses
   (:func:`afd_protocol.extent_rules`: the same rules, evaluated on the device, so no host
   round trip and no bytes beyond the header's counts) and puts its share of every extent
   with ``nvshmemx_putmem_block`` to the same offset of the peer's window;
2. ``nvshmemx_quiet_on_stream``: every put of step 1 is complete at its destination;
3. ``_put_flags_kernel``, one program: ``nvshmem_fence`` and one ``nvshmem_int_p`` per
   destination storing the flag value (read from pinned host memory when it runs, so a
   CUDA graph can capture all three steps once and replay them with new values).

A receiver is unchanged: it waits on its own flag words, and a flag is stored only after
the quiet, so the payload it announces is there. The device functions come from NVSHMEM's
``libnvshmem_device.bc`` (next to the host library), linked by Triton; every module that
calls them is registered with ``nvshmemx_cumodule_init`` once, when :meth:`PutBlock.prepare`
loads it (a capture cannot load code, so prepare runs before).

``copy=True`` (what the interpreter runs, and a test of step 1's arithmetic anywhere) does
step 1 with plain loads and stores to mapped destination addresses instead of puts. Its
reference is :func:`reference_put_extents`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language import core

from afd_protocol import HEADER_FIXED_WORDS, AFDError, WindowLayout, extent_rules, used_extents
from afd_protocol.window import PublishBlock
from afd_transport_nvshmem.binding import NvshmemLibrary
from afd_transport_nvshmem.device_wait import HostPointer
from afd_transport_nvshmem.library import NvshmemUnavailable

DEVICE_LIBRARY_NAME = "libnvshmem_device.bc"
CHUNKS = 128
"""Programs per destination of the put kernel: one CTA's puts reach a fraction of the
copy bandwidth, so each extent is split into this many pieces. On one H200 under MPS
(``afd bench transport``, 'put graphs' at 4K tokens) 32 gave 1.95 ms per layer, 128 gave
1.07 ms."""
COPY_BLOCK = 1024
"""Bytes per step of the ``copy=True`` variant's loop."""
_REGISTERED_MODULES: set[int] = set()
"""CUDA modules already given NVSHMEM's device state (kernels are shared between blocks)."""
RULE_COLUMNS = 6
"""A rule row on the device: offset, capacity, unit bytes, count word a, count word b,
count base (HEADER_FIXED_WORDS for the header, else 0)."""


def find_device_library(host_library: Path) -> Path:
    """NVSHMEM's device bitcode, which ships beside ``libnvshmem_host.so.3``."""
    path = host_library.parent / DEVICE_LIBRARY_NAME
    if not path.is_file():
        raise NvshmemUnavailable(
            f"{path} not found: the put path links NVSHMEM's device library into its "
            f"kernels; install an NVSHMEM wheel that ships it (nvidia-nvshmem-cu13 >= 3.3) "
            f"or use data_path='mapped' on one node"
        )
    return path


# ---- NVSHMEM device functions, declared for Triton --------------------------------------


@core.extern
def _putmem_block(dest, source, nbytes, pe, _semantic=None):
    # void nvshmemx_putmem_block(void *dest, const void *source, size_t nelems, int pe)
    return core.extern_elementwise(
        "",
        "",
        [dest, source, nbytes, pe],
        {
            (core.int64, core.int64, core.int64, core.int32): (
                "nvshmemx_putmem_block",
                core.int32,
            )
        },
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def _int_p(dest, value, pe, _semantic=None):
    # void nvshmem_int_p(int *dest, int value, int pe)
    return core.extern_elementwise(
        "",
        "",
        [dest, value, pe],
        {(core.int64, core.int32, core.int32): ("nvshmem_int_p", core.int32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def _fence(_semantic=None):
    # void nvshmem_fence(void)
    return core.extern_elementwise(
        "", "", [], {(): ("nvshmem_fence", core.int32)}, is_pure=False, _semantic=_semantic
    )


# ---- the kernels -------------------------------------------------------------------------


@triton.jit(do_not_specialize=["slot_offset"])
def _put_extents_kernel(
    staging,  # int64 [destinations]: address of each destination's staging window
    dest_bases,  # int64 [destinations]: the window address a put or copy targets
    pes,  # int32 [destinations]
    rules,  # int64 [N_RULES * RULE_COLUMNS]
    slot_offset,
    N_RULES: tl.constexpr,
    RULE_COLUMNS: tl.constexpr,
    CHUNKS: tl.constexpr,
    COPY: tl.constexpr,
    COPY_BLOCK: tl.constexpr,
):
    d = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    source = tl.load(staging + d) + slot_offset
    target = tl.load(dest_bases + d) + slot_offset
    pe = tl.load(pes + d)
    header = source.to(tl.pointer_type(tl.int32))
    for r in tl.static_range(N_RULES):
        offset = tl.load(rules + r * RULE_COLUMNS)
        capacity = tl.load(rules + r * RULE_COLUMNS + 1)
        unit = tl.load(rules + r * RULE_COLUMNS + 2)
        count_a = tl.load(header + tl.load(rules + r * RULE_COLUMNS + 3)).to(tl.int64)
        count_b = tl.load(header + tl.load(rules + r * RULE_COLUMNS + 4)).to(tl.int64)
        count = tl.maximum(tl.maximum(count_a, count_b), 0) + tl.load(rules + r * RULE_COLUMNS + 5)
        nbytes = tl.minimum(unit * count, capacity)
        piece = tl.cdiv(tl.cdiv(nbytes, CHUNKS), 16) * 16
        start = chunk * piece
        length = tl.minimum(nbytes - start, piece)
        if length > 0:
            if COPY:
                src = (source + offset + start).to(tl.pointer_type(tl.uint8))
                dst = (target + offset + start).to(tl.pointer_type(tl.uint8))
                step = length * 0
                while step < length:
                    offs = step + tl.arange(0, COPY_BLOCK)
                    mask = offs < length
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
                    step += COPY_BLOCK
            else:
                _putmem_block(target + offset + start, source + offset + start, length, pe)


@triton.jit(do_not_specialize=["flag_offset"])
def _put_flags_kernel(request, dest_bases, pes, flag_offset):
    # request: pinned host memory [n, value 0, ..., value n-1], written before the launch.
    n = tl.load(request, volatile=True)
    _fence()
    for i in range(n):
        value = tl.load(request + 1 + i, volatile=True)
        _int_p(tl.load(dest_bases + i) + flag_offset, value, tl.load(pes + i))


def rule_table(window: WindowLayout, device: torch.device) -> torch.Tensor:
    """int64 ``[rules * RULE_COLUMNS]`` on ``device``: :func:`afd_protocol.extent_rules`
    of ``window``'s slot, one row per non-empty field (columns: :data:`RULE_COLUMNS`)."""
    rows = []
    for rule in extent_rules(window.slot):
        words = (rule.count_words * 2)[:2]
        base = HEADER_FIXED_WORDS if rule.field == "header" else 0
        rows += [rule.offset, rule.capacity, rule.unit_bytes, *words, base]
    return torch.tensor(rows, dtype=torch.int64).to(device)


def copy_extents(
    staging: Sequence[int],
    dest_bases: Sequence[int],
    window: WindowLayout,
    slot_offset: int,
    device: torch.device,
    chunks: int = CHUNKS,
) -> None:
    """Step 1 with loads and stores (``COPY``): copy the used extents of the slot at
    ``slot_offset`` of each staging window (addresses) to the same offset of the matching
    destination window (addresses this device can store to), on the current stream, with
    ``chunks`` programs per destination (the put uses :data:`CHUNKS`)."""
    rules = rule_table(window, device)
    n = len(staging)
    _put_extents_kernel[(n, chunks)](
        torch.tensor(list(staging), dtype=torch.int64).to(device),
        torch.tensor(list(dest_bases), dtype=torch.int64).to(device),
        torch.zeros(n, dtype=torch.int32, device=device),
        rules,
        slot_offset,
        N_RULES=rules.numel() // RULE_COLUMNS,
        RULE_COLUMNS=RULE_COLUMNS,
        CHUNKS=chunks,
        COPY=True,
        COPY_BLOCK=COPY_BLOCK,
    )


def reference_put_extents(
    staging: torch.Tensor, destination: torch.Tensor, window: WindowLayout, slot_offset: int
) -> int:
    """What step 1 does, in torch: copy the used extents (by :func:`afd_protocol.
    used_extents` of the staged header) of the slot at ``slot_offset`` from ``staging`` to
    ``destination`` (flat uint8 windows); returns the bytes copied."""
    words = window.slot.header_words
    header = staging[slot_offset : slot_offset + 4 * words].view(torch.int32).tolist()
    moved = 0
    for extent in used_extents(window.slot, header):
        start = slot_offset + extent.offset
        destination[start : start + extent.nbytes] = staging[start : start + extent.nbytes]
        moved += extent.nbytes
    return moved


class PutBlock(PublishBlock):
    """One slot's publish to several peers by puts: the three steps of the module
    docstring, launched on the current stream; capturable once :meth:`prepare` ran."""

    def __init__(
        self,
        lib: NvshmemLibrary,
        device_library: Path,
        device: torch.device,
        staging: Sequence[int],
        window_address: int,
        pes: Sequence[int],
        window: WindowLayout,
        slot_offset: int | None,
        flag_offset: int,
    ) -> None:
        """Publishes the slot at ``slot_offset`` of each staging window (``staging``: one
        address per destination) to PEs ``pes``, then sets the int32 word at
        ``flag_offset`` of their windows (``window_address``: this PE's window, the
        symmetric address puts name). ``slot_offset=None``: the word only (an abort)."""
        n = len(pes)
        self._lib = lib
        self._device = device
        self._extern = {"libnvshmem_device": str(device_library)}
        self._rules = rule_table(window, device)
        self._staging = torch.tensor(list(staging), dtype=torch.int64).to(device)
        # Puts name the destination by its symmetric address here and the PE.
        self._bases = torch.full((n,), window_address, dtype=torch.int64, device=device)
        self._pes = torch.tensor(list(pes), dtype=torch.int32).to(device)
        self._slot_offset = slot_offset
        self._flag_offset = flag_offset
        self._request = torch.zeros(1 + n, dtype=torch.int32, pin_memory=True)
        self._words = (ctypes.c_int32 * (1 + n)).from_address(self._request.data_ptr())
        self._request_pointer = HostPointer(self._request)
        self._done = torch.Event(device=device)
        self._prepared = False

    @property
    def size(self) -> int:
        return self._pes.numel()

    def write(self, values: Sequence[int]) -> None:
        self._check(values)
        self._words[0] = len(values)
        self._words[1 : len(values) + 1] = list(values)

    @staticmethod
    def _call(kernel: Any, warmup: bool, *args: Any, **options: Any) -> Any:
        """``kernel`` compiled and loaded without running (``warmup``: Triton's
        ``warmup``) or launched (its ``run``, which ``kernel[grid](...)`` calls)."""
        if warmup:
            return kernel.warmup(*args, **options)
        return kernel.run(*args, warmup=False, **options)

    def _extents(self, warmup: bool = False):
        return self._call(
            _put_extents_kernel,
            warmup,
            self._staging,
            self._bases,
            self._pes,
            self._rules,
            self._slot_offset or 0,
            N_RULES=self._rules.numel() // RULE_COLUMNS,
            RULE_COLUMNS=RULE_COLUMNS,
            CHUNKS=CHUNKS,
            COPY=False,
            COPY_BLOCK=COPY_BLOCK,
            extern_libs=self._extern,
            grid=(self.size, CHUNKS),
        )

    def _flags(self, warmup: bool = False):
        return self._call(
            _put_flags_kernel,
            warmup,
            self._request_pointer,
            self._bases,
            self._pes,
            self._flag_offset,
            extern_libs=self._extern,
            num_warps=1,  # every thread of the program puts the flag: the fewest threads
            grid=(1,),
        )

    def launch(self) -> None:
        if not self._prepared:
            raise AFDError(
                "PutBlock.launch before prepare(): its kernels call NVSHMEM, and a module "
                "NVSHMEM has not registered must not run"
            )
        stream = torch.cuda.current_stream(self._device).cuda_stream
        if self._slot_offset is not None:
            self._extents()
            self._lib.quiet_on_stream(stream)
        self._flags()
        if self._slot_offset is None:
            self._lib.quiet_on_stream(stream)  # an abort: delivered before the caller exits

    def prepare(self) -> None:
        """Compile both kernels, load them and register their modules with NVSHMEM (no
        launch: a kernel must not run before its module is registered). Once per block."""
        if self._prepared:
            return
        kernels = [self._flags(warmup=True)]
        if self._slot_offset is not None:
            kernels.append(self._extents(warmup=True))
        for compiled in kernels:
            compiled.run  # noqa: B018 - loads the module (Triton loads lazily)
            if compiled.module not in _REGISTERED_MODULES:
                self._lib.cumodule_init(compiled.module)
                _REGISTERED_MODULES.add(compiled.module)
        self._prepared = True

    def publish(self, values: Sequence[int]) -> None:
        """Write ``values`` and launch, eagerly (waiting first if the previous launch out of
        this block has not run yet: it reads the pinned values when it runs)."""
        if not self._done.query():
            self._done.synchronize()
        self.prepare()
        self.write(values)
        self.launch()
        self._done.record()


def release_modules(lib: NvshmemLibrary) -> None:
    """Take NVSHMEM's device state back from every module :class:`PutBlock` registered
    (the transport's ``close``, before NVSHMEM finalises): a later initialisation in this
    process registers them afresh instead of keeping the old state."""
    while _REGISTERED_MODULES:
        lib.cumodule_finalize(_REGISTERED_MODULES.pop())
