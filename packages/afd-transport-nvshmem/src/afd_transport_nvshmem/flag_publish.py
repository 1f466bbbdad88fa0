# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Every flag of a dispatch published by one kernel (``NvshmemOptions(publish="kernel")``).

The default publish is one ``cuStreamWriteValue32`` per destination, each a launch of its
own with the flag value fixed at enqueue time. :class:`FlagPublisher` instead launches one
Triton program that reads the values from a small request block in *pinned host memory*
(written by the host just before, through a ``ctypes`` array: a few microseconds) and
stores each one to its peer's flag word with a release store at system scope. So a
dispatch to F FFN ranks costs one launch instead of F, and -- the reason it exists -- a
CUDA graph can hold it: the launch's arguments (the request block, the flag addresses)
stay the same from one replay to the next, only the words in the block change.

Why the payload is visible when the flag is (as for the stream write): the rows and the
header are written earlier on the same stream, so they happen before this kernel starts,
and its release store at system scope makes everything that happened before it visible
to a peer whose acquire load reads the flag (the receivers' waits load with acquire).

A request block is reused by the next publish with the same key; an event recorded after
the launch makes that reuse wait if the kernel has not run yet (the window protocol never
republishes a flag before its answer, so in practice it never waits). Request block, int32:
``[n, value 0, ..., value n-1]``; the addresses are an int64 tensor on the device, one per
value, made once per key.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable, Sequence

import torch
import triton
import triton.language as tl

from afd_protocol.window import PublishBlock
from afd_transport_nvshmem.device_wait import HostPointer


@triton.jit
def _publish_kernel(request, addresses, BLOCK: tl.constexpr):
    # request: pinned host memory, written by the host before the launch.
    n = tl.load(request, volatile=True)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    values = tl.load(request + 1 + offs, mask=mask, other=0, volatile=True)
    where = tl.load(addresses + offs, mask=mask, other=0)
    flags = where.to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(flags, values, mask=mask, sem="release", scope="sys")


class FlagBlock(PublishBlock):
    """One key's flags: the addresses (int64, on the device) and the request block (pinned),
    with the event recorded after its last eager launch (None on the CPU, where the
    interpreter runs inline). :meth:`launch` is what a CUDA graph captures; :meth:`publish`
    is the eager write-and-launch."""

    def __init__(self, device: torch.device, block: int, addresses: Sequence[int]) -> None:
        on_gpu = device.type == "cuda"
        self._device = device
        self._block = block
        self._request = torch.zeros(1 + block, dtype=torch.int32, pin_memory=on_gpu)
        self._words = (ctypes.c_int32 * self._request.numel()).from_address(
            self._request.data_ptr()
        )
        self._addresses = torch.tensor(list(addresses), dtype=torch.int64).to(device)
        self._argument: torch.Tensor | HostPointer = (
            HostPointer(self._request) if on_gpu else self._request
        )
        self._done = torch.Event(device=device) if on_gpu else None
        self._prepared = False

    @property
    def size(self) -> int:
        return self._addresses.numel()

    def write(self, values: Sequence[int]) -> None:
        self._check(values)
        n = len(values)
        self._words[0] = n
        self._words[1 : n + 1] = list(values)

    def launch(self) -> None:
        _publish_kernel[(1,)](self._argument, self._addresses, BLOCK=self._block)

    def prepare(self) -> None:
        """Compile and load the kernel with a launch that sets no flag (the block's count is
        0 while it runs); returns once it ran. Once per block: later calls return at once."""
        if self._prepared:
            return
        self._prepared = True
        if self._done is not None and not self._done.query():
            self._done.synchronize()
        self._words[0] = 0
        self.launch()
        if self._done is not None:
            self._done.record()  # the current stream
            self._done.synchronize()  # before the host writes the next count

    def publish(self, values: Sequence[int]) -> None:
        """Write ``values`` and launch, eagerly (waiting first if the previous launch out of
        this block has not run yet)."""
        if self._done is not None and not self._done.query():
            self._done.synchronize()  # the previous launch still reads this block
        self.write(values)
        self.launch()
        if self._done is not None:
            self._done.record()  # the current stream


class FlagPublisher:
    """Sets several flag words (anywhere this device can store: peers' windows through
    ``nvshmem_ptr``) to given values in one launch on the current stream; see the module
    docstring. ``max_flags`` bounds the flags of one publish (the program's block)."""

    def __init__(self, device: torch.device, max_flags: int) -> None:
        if max_flags < 1:
            raise ValueError(f"max_flags must be >= 1, got {max_flags}")
        self._device = device
        self._block = triton.next_power_of_2(max_flags)
        self._max = max_flags
        self._targets: dict[Hashable, FlagBlock] = {}

    def publish(
        self, key: Hashable, values: Sequence[int], addresses: Callable[[], Sequence[int]]
    ) -> None:
        """Store ``values[i]`` into the int32 word at ``addresses()[i]``, after everything
        earlier on the current stream. ``addresses`` is called on a key's first publish
        only: every publish with ``key`` sets the same words."""
        target = self.block(key, addresses)
        if len(values) != target.size:
            raise ValueError(
                f"a publish sets 1..{self._max} flags, one value per address; got "
                f"{len(values)} values for {target.size} addresses"
            )
        target.publish(values)

    def block(self, key: Hashable, addresses: Callable[[], Sequence[int]]) -> FlagBlock:
        """``key``'s :class:`FlagBlock` (made on first use, from ``addresses()``)."""
        target = self._targets.get(key)
        if target is None:
            where = addresses()
            if not 1 <= len(where) <= self._max:
                raise ValueError(f"a publish sets 1..{self._max} flags, got {len(where)}")
            target = FlagBlock(self._device, self._block, where)
            self._targets[key] = target
        return target
