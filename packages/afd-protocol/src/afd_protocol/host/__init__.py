"""The host transport: windows in POSIX shared memory, for processes on one machine."""

from afd_protocol.host.launcher import LaunchError, RankResult, launch
from afd_protocol.host.segments import leftover_segments
from afd_protocol.host.transport import HostTransport

__all__ = ["HostTransport", "LaunchError", "RankResult", "launch", "leftover_segments"]
