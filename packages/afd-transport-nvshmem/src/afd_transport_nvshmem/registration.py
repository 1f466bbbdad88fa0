"""The NVSHMEM transport's entry in afd's transport registry (``afd_protocol.transports``).

Registered in this package's ``pyproject.toml`` as ``nvshmem``. Importing this module loads
neither NVSHMEM nor the transport: :mod:`afd_transport_nvshmem.launch_support` is imported
when a factory is built, so listing the transports on a CPU machine stays cheap and safe.
"""

from __future__ import annotations

import functools

from afd_protocol import (
    DeviceSharing,
    SlotLayout,
    TransportFactory,
    TransportOptions,
    TransportSpec,
)


def _nvshmem_factory(slot: SlotLayout, options: TransportOptions) -> TransportFactory:
    """:func:`afd_transport_nvshmem.launch_support.nvshmem_transport`: its waits are the
    endpoints'; ``options.exchange_graphs`` becomes the transport option of that name, and
    ``options.peer_puts`` ``data_path="put"``."""
    from afd_transport_nvshmem.launch_support import nvshmem_transport

    if not options.exchange_graphs and not options.peer_puts:
        return nvshmem_transport
    from afd_transport_nvshmem.transport import NvshmemOptions

    chosen = NvshmemOptions(
        exchange_graphs=options.exchange_graphs,
        data_path="put" if options.peer_puts else "mapped",
    )
    return functools.partial(nvshmem_transport, options=chosen)


NVSHMEM_TRANSPORT = TransportSpec(
    name="nvshmem",
    summary="afd's windows in NVSHMEM memory peer-mapped between the GPUs of one node (NVLink "
    "or P2P), one rank per GPU or several under CUDA MPS",
    devices=frozenset({"cuda"}),
    device_sharing=DeviceSharing.MPS,
    requirement="afd-transport-nvshmem",
    build=_nvshmem_factory,
    exchange_graphs=True,
    peer_puts=True,
)
"""``nvshmem``: one rank per GPU (or several under MPS), bootstrapped through the launcher's
rendezvous directory."""
