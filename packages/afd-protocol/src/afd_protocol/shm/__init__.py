"""The shared-memory transport: AFD windows in POSIX shared memory, for processes on one
machine (the embedded default on CPU, and the reference the other transports are checked
against)."""

from afd_protocol.shm.segments import leftover_segments, remove_segments
from afd_protocol.shm.transport import ShmTransport

__all__ = ["ShmTransport", "leftover_segments", "remove_segments"]
