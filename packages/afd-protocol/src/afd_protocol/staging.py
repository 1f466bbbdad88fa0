"""Header writes that never make the host wait for the device.

A header is encoded on the host and copied into a slot of a peer's window. On an
accelerator, a copy from ordinary (pageable) host memory makes the host wait until the
stream has drained -- that is, until the payload written before it, or the expert
computation before that, has finished. The sender would sit in that wait instead of
going back to serve or to compute the next stage.

:class:`HeaderStaging` keeps one page-locked buffer per (peer, ring) slot and issues the
copy asynchronously, on the same stream as the payload and before the flag, so ordering
is unchanged. A buffer is reused only by the next message into the same slot; an event
recorded after its copy makes that reuse wait for the copy (in the protocol the peer has
answered in between, so the wait returns at once; it only matters when a shutdown
message follows a reply in the same slot). On the host transport the copy is a plain
``memcpy`` and none of this is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from afd_protocol.header import Header, encode_words


class HeaderStaging:
    """Page-locked staging buffers for the headers one endpoint sends."""

    def __init__(self, device: torch.device, max_words: int) -> None:
        self._device = device
        self._max_words = max_words
        self._async = device.type != "cpu"
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Event]] = {}

    def write(self, destination: torch.Tensor, header: Header, key: tuple[int, int]) -> None:
        """Copy ``header`` into ``destination`` (a slot's int32 header field) for slot ``key``."""
        words = torch.tensor(encode_words(header), dtype=torch.int32)
        n = words.numel()
        if not self._async:
            destination[:n].copy_(words)
            return
        entry = self._buffers.get(key)
        if entry is None:
            buffer = torch.empty(self._max_words, dtype=torch.int32, pin_memory=True)
            entry = (buffer, torch.Event(device=self._device))
            self._buffers[key] = entry
        else:
            if not entry[1].query():  # the previous copy out of this buffer has not run
                entry[1].synchronize()
        buffer, done = entry
        buffer[:n].copy_(words)
        destination[:n].copy_(buffer[:n], non_blocking=True)
        done.record(torch.accelerator.current_stream(self._device))


def host_to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, without making the host wait for it.

    The copy goes through page-locked memory and is stream-ordered; torch's pinned-memory
    allocator keeps the source alive until the copy has run.
    """
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
