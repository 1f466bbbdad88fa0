# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Device-side waits written in Triton.

``wait_any`` runs one small program that polls the watched flag words of this rank's
window with acquire loads at system scope and, as soon as one differs from the value last
seen (or a watched peer's abort word is set, or its poll budget is spent), writes the
flag values and a status word into *pinned host memory* with a release store. The host
spins on that host memory: no ``cudaMemcpy`` and no stream synchronisation per check,
which is what makes a host-polled wait cost a device-to-host round trip each time.

``pingpong`` is a persistent kernel for the latency benchmark: it bounces a flag between
two GPUs N times without the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STATUS_CHANGED = 1
STATUS_SLICE_OVER = 2
STATUS_ABORTED = 3


@triton.jit
def _wait_any_kernel(
    flags,
    index,
    last,
    n,
    aborts,
    peers,
    n_peers,
    out,
    max_polls,
    BLOCK: tl.constexpr,
    PEER_BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    where = tl.load(index + offs, mask=mask, other=0)
    seen = tl.load(last + offs, mask=mask, other=0)
    poffs = tl.arange(0, PEER_BLOCK)
    pmask = poffs < n_peers
    pwhere = tl.load(peers + poffs, mask=pmask, other=0)
    status = 0
    polls = 0
    current = seen
    while status == 0:
        loaded = tl.atomic_add(flags + where, 0, mask=mask, sem="acquire", scope="sys")
        current = tl.where(mask, loaded, seen)
        changed = tl.sum(tl.where(mask & (current != seen), 1, 0), axis=0)
        abort = tl.atomic_add(aborts + pwhere, 0, mask=pmask, sem="acquire", scope="sys")
        aborted = tl.sum(tl.where(pmask & (abort != 0), 1, 0), axis=0)
        polls += 1
        status = tl.where(
            changed > 0,
            1,
            tl.where(aborted > 0, 3, tl.where(polls >= max_polls, 2, 0)),
        )
    tl.store(out + offs, current, mask=mask)
    tl.atomic_xchg(out + BLOCK, status, sem="release", scope="sys")


class _HostPointer:
    """Lets Triton take pinned host memory as a pointer argument (UVA: same address)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return int(self._tensor.data_ptr())


class DeviceWaiter:
    """Reusable state for device-side ``wait_any`` calls of one transport."""

    def __init__(self, flags: torch.Tensor, aborts: torch.Tensor, max_indices: int) -> None:
        self.flags = flags
        self.aborts = aborts
        self.block = triton.next_power_of_2(max(1, max_indices))
        self.out = torch.zeros(self.block + 1, dtype=torch.int32).pin_memory()
        self.seen = torch.zeros(self.block, dtype=torch.int32).pin_memory()
        self.stream = torch.cuda.Stream(device=flags.device)  # type: ignore[no-untyped-call]
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def _device_ints(self, values: tuple[int, ...]) -> torch.Tensor:
        tensor = self._cache.get(values)
        if tensor is None:
            tensor = torch.tensor(list(values) or [0], dtype=torch.int32, device=self.flags.device)
            if len(self._cache) < 256:
                self._cache[values] = tensor
        return tensor

    def launch(
        self, indices: tuple[int, ...], last: tuple[int, ...], peers: tuple[int, ...], polls: int
    ) -> None:
        """Start one poll slice; then read :meth:`status` until it is non-zero.

        The last-seen values go to the kernel through the same pinned buffer it answers in
        (it reads them over PCIe once), so a launch needs no host-to-device copy.
        """
        self.out[self.block] = 0
        self.seen[: len(last)] = torch.tensor(last, dtype=torch.int32)
        index = self._device_ints(indices)
        with torch.cuda.stream(self.stream):
            peer_block = triton.next_power_of_2(max(1, len(peers)))
            _wait_any_kernel[(1,)](
                self.flags,
                index,
                _HostPointer(self.seen),
                len(indices),
                self.aborts,
                self._device_ints(peers),
                len(peers),
                _HostPointer(self.out),
                polls,
                BLOCK=self.block,
                PEER_BLOCK=peer_block,
            )

    def status(self) -> int:
        return int(self.out[self.block])

    def values(self, n: int) -> list[int]:
        return [int(v) for v in self.out[:n].tolist()]


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
