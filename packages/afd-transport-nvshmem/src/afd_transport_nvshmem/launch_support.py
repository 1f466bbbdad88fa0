"""A transport factory for :func:`afd_protocol.launch.launch`: one GPU per rank, NVSHMEM
bootstrapped through the launcher's private rendezvous directory (no TCP port)."""

from __future__ import annotations

from afd_protocol import DirectoryStore, Role, WindowLayout
from afd_transport_nvshmem.transport import NvshmemConnection, NvshmemOptions, NvshmemTransport


def nvshmem_transport(
    window: WindowLayout,
    role: Role,
    rank: int,
    rendezvous: str,
    connect_timeout: float,
    options: NvshmemOptions | None = None,
) -> NvshmemConnection:
    """Open rank ``rank``'s NVSHMEM transport, as its connection (other ``options``: bind them
    with ``functools.partial(nvshmem_transport, options=NvshmemOptions(wait="host"))``)."""
    store = DirectoryStore(rendezvous, timeout=connect_timeout)
    transport = NvshmemTransport(
        window, role, rank, store, options=options, connect_timeout=connect_timeout
    )
    return NvshmemConnection(transport)
