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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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


@dataclass
class _Target:
    """One key's flag addresses (device) and request block (pinned), with the event
    recorded after its last launch (None on the CPU, where the interpreter runs inline)."""

    addresses: torch.Tensor
    request: torch.Tensor
    argument: torch.Tensor | HostPointer
    """How the kernel takes :attr:`request`: pinned host memory as a pointer on a GPU."""
    words: ctypes.Array[ctypes.c_int32]
    done: torch.Event | None


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
        self._targets: dict[Hashable, _Target] = {}

    def publish(
        self, key: Hashable, values: Sequence[int], addresses: Callable[[], Sequence[int]]
    ) -> None:
        """Store ``values[i]`` into the int32 word at ``addresses()[i]``, after everything
        earlier on the current stream. ``addresses`` is called on a key's first publish
        only: every publish with ``key`` sets the same words."""
        n = len(values)
        target = self._targets.get(key)
        if target is None:
            where = addresses()
            if not 1 <= len(where) <= self._max:
                raise ValueError(f"a publish sets 1..{self._max} flags, got {len(where)}")
            target = self._target(where)
            self._targets[key] = target
        if n != target.addresses.numel():
            raise ValueError(
                f"a publish sets 1..{self._max} flags, one value per address; got {n} values "
                f"for {target.addresses.numel()} addresses"
            )
        if target.done is not None and not target.done.query():
            target.done.synchronize()  # the previous launch still reads this block
        target.words[0] = n
        target.words[1 : n + 1] = list(values)
        _publish_kernel[(1,)](target.argument, target.addresses, BLOCK=self._block)
        if target.done is not None:
            target.done.record(torch.cuda.current_stream(self._device))

    def _target(self, addresses: Sequence[int]) -> _Target:
        on_gpu = self._device.type == "cuda"
        request = torch.zeros(1 + self._block, dtype=torch.int32, pin_memory=on_gpu)
        words = (ctypes.c_int32 * request.numel()).from_address(request.data_ptr())
        table = torch.tensor(list(addresses), dtype=torch.int64).to(self._device)
        argument = HostPointer(request) if on_gpu else request
        done = torch.Event(device=self._device) if on_gpu else None
        return _Target(table, request, argument, words, done)
