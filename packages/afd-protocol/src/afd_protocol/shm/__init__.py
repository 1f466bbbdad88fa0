"""The shared-memory transport: AFD windows in POSIX shared memory, for processes on one
machine (the embedded default on CPU, and the reference the other transports are checked
against)."""

from afd_protocol.shm.segments import (
    NAMESPACE_ENV,
    leftover_segments,
    remove_segments,
    segment_prefix,
)
from afd_protocol.shm.transport import ShmTransport

__all__ = [
    "NAMESPACE_ENV",
    "ShmTransport",
    "leftover_segments",
    "remove_segments",
    "segment_prefix",
]
