"""The shared-memory transport's entry in the transport registry (:mod:`afd_protocol.transports`).

Registered in this package's ``pyproject.toml`` as ``shm``; the launcher
(:mod:`afd_protocol.launch`) is imported only when a factory is built.
"""

from __future__ import annotations

from afd_protocol.core.layout import SlotLayout
from afd_protocol.transports import DeviceSharing, TransportFactory, TransportOptions, TransportSpec


def _shm_factory(slot: SlotLayout, options: TransportOptions) -> TransportFactory:
    """:func:`afd_protocol.launch.shm_transport`: every geometry fits shared memory, and its
    waits are the endpoints' (nothing in ``options`` applies)."""
    from afd_protocol.launch import shm_transport

    return shm_transport


SHM_TRANSPORT = TransportSpec(
    name="shm",
    summary="afd's windows in shared memory between the processes of one machine (on CUDA, "
    "rows are staged through host memory)",
    devices=frozenset({"cpu", "cuda"}),
    device_sharing=DeviceSharing.FREE,
    requirement="afd-protocol",
    build=_shm_factory,
)
"""``shm``: :class:`~afd_protocol.shm.ShmTransport` through the launcher's rendezvous
directory."""
