"""Small host<->device transfers through page-locked memory that never make the host wait.

A header is encoded on the host and copied into a slot of a peer's window. On an
accelerator, a copy from ordinary (pageable) host memory makes the host wait until the
stream has drained -- that is, until the payload written before it, or the expert
computation before that, has finished. The sender would sit in that wait instead of
going back to serve or to compute the next stage.

:class:`HeaderUpload` keeps one page-locked buffer per (peer, ring) slot and issues the
copy asynchronously, on the same stream as the payload and before the flag, so ordering
is unchanged. A buffer is reused only by the next message into the same slot; an event
recorded after its copy makes that reuse wait for the copy (in the protocol the peer has
answered in between, so the wait returns at once; it only matters when a shutdown
message follows a reply in the same slot). On the host transport the copy is a plain
``memcpy`` and none of this is needed. :class:`PinnedReadback` is the other direction:
small device values copied to the host without blocking, read when they are needed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from afd_protocol.core.header import Header, encode_words

_CTYPES = {torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64}


@dataclass(frozen=True)
class _Buffer:
    tensor: torch.Tensor
    """Page-locked host memory."""
    words: Any
    """A ``ctypes`` array over the same memory."""
    done: torch.Event
    """Recorded after the last copy out of ``tensor``."""


class PinnedUpload:
    """Small integer arrays copied host to device through page-locked buffers, one per key.

    Values are written into the page-locked buffer through a ``ctypes`` array over it (a
    few microseconds, against tens for building a tensor and copying it), then copied to
    the device asynchronously. A buffer is reused only by the next copy with the same key;
    an event recorded after the copy makes that reuse wait for it if it has not run.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._async = device.type != "cpu"
        self._buffers: dict[object, _Buffer] = {}

    def copy(self, destination: torch.Tensor, values: Sequence[int], key: object) -> None:
        """``destination[:len(values)] = values`` (an int32 or int64 device tensor)."""
        n = len(values)
        if not self._async:
            destination[:n].copy_(torch.tensor(values, dtype=destination.dtype))
            return
        entry = self._buffers.get(key)
        if entry is None or entry.tensor.numel() < n or entry.tensor.dtype != destination.dtype:
            tensor = torch.empty(max(n, 1), dtype=destination.dtype, pin_memory=True)
            words = (_CTYPES[destination.dtype] * tensor.numel()).from_address(tensor.data_ptr())
            entry = _Buffer(tensor, words, torch.Event(device=self._device))
            self._buffers[key] = entry
        elif not entry.done.query():  # the previous copy out of this buffer has not run
            entry.done.synchronize()
        entry.words[:n] = values
        destination[:n].copy_(entry.tensor[:n], non_blocking=True)
        entry.done.record()  # the current stream (no device lookup in Python)


class HeaderUpload:
    """Encodes headers and uploads them with :class:`PinnedUpload`, one buffer per slot."""

    def __init__(self, device: torch.device) -> None:
        self._upload = PinnedUpload(device)

    def write(self, destination: torch.Tensor, header: Header, key: tuple[int, int]) -> None:
        """Copy ``header`` into ``destination`` (a slot's int32 header field) for slot ``key``."""
        self._upload.copy(destination, encode_words(header), key)


class PinnedReadback:
    """Small device tensors copied to page-locked host memory without blocking, read later.

    :meth:`start` enqueues the copy on the current stream; :meth:`read` returns the values
    once the copy has run (it waits only if the stream has not reached it yet) and may be
    called again for the same start. One buffer per key: starting a key again reuses it,
    which is safe when both copies are on one stream.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._async = device.type != "cpu"
        self._pending: dict[object, tuple[torch.Tensor, torch.Event | None]] = {}
        self._buffers: dict[object, torch.Tensor] = {}

    def start(self, source: torch.Tensor, key: object) -> None:
        if not self._async:
            self._pending[key] = (source.clone(), None)
            return
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            self._buffers[key] = buffer
        buffer.copy_(source, non_blocking=True)
        done = torch.Event(device=self._device)
        done.record()  # the current stream
        self._pending[key] = (buffer, done)

    def read(self, key: object) -> list[int]:
        buffer, done = self._pending[key]
        if done is not None and not done.query():
            done.synchronize()
        return [int(v) for v in buffer.tolist()]
