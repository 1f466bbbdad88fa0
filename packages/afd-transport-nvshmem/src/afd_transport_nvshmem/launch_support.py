"""A transport factory for :func:`afd_protocol.host.launch`: one GPU per rank, NVSHMEM
bootstrapped through the launcher's private rendezvous directory (no TCP port)."""

from __future__ import annotations

import os

from afd_protocol import Role, Transport, WindowLayout
from afd_protocol.host.rendezvous import DirectoryStore
from afd_transport_nvshmem.transport import NvshmemTransport


def nvshmem_transport(
    window: WindowLayout, role: Role, rank: int, rendezvous: str, connect_timeout: float
) -> Transport:
    """Open rank ``rank``'s NVSHMEM transport; ``AFD_NVSHMEM_WAIT`` picks device/host waits."""
    store = DirectoryStore(rendezvous, timeout=connect_timeout)
    wait = os.environ.get("AFD_NVSHMEM_WAIT", "device")
    return NvshmemTransport(window, role, rank, store, wait=wait, connect_timeout=connect_timeout)
