"""Bootstrapping NVSHMEM ourselves, through any key-value store.

The AFD world is two independent role groups, so NVSHMEM is not initialised through a
torch process group: rank 0 makes a unique id, publishes it in a store (a
:class:`~afd_protocol.TcpStore` on 127.0.0.1, a :class:`~afd_protocol.DirectoryStore`, or
any :class:`~afd_protocol.KeyValueStore`), every rank initialises with it, and the AFD world *is*
``NVSHMEM_TEAM_WORLD`` -- PE numbers equal AFD world ranks, which is asserted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from afd_protocol import KeyValueStore, TopologyError
from afd_transport_nvshmem.binding import NvshmemLibrary

SINGLE_NODE_DEFAULTS: Mapping[str, str] = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",  # one node: NVLink/P2P only, no network transport
    "NVSHMEM_DISABLE_NVLS": "1",  # no NVLink multicast (it can take shared GPUs down)
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",  # bootstrap on loopback only
    "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY": "AF_INET",
}
HEAP_MARGIN = 512 << 20
"""Symmetric heap reserved beyond the window (NVSHMEM's own internal allocations)."""


def apply_single_node_defaults(window_bytes: int) -> dict[str, str]:
    """Set the single-node defaults unless the user set them; return what is in force."""
    for key, value in SINGLE_NODE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    heap = -(-(window_bytes + HEAP_MARGIN) // (2 << 20)) * (2 << 20)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap))
    keys = [*SINGLE_NODE_DEFAULTS, "NVSHMEM_SYMMETRIC_SIZE"]
    return {key: os.environ[key] for key in keys}


def bootstrap(
    lib: NvshmemLibrary, store: KeyValueStore, rank: int, world_size: int, key: str
) -> None:
    """Initialise NVSHMEM as PE ``rank`` of ``world_size`` (collective across the world)."""
    if rank == 0:
        store.set(key, lib.unique_id())
    uid = store.get(key)
    lib.init(bytes(uid), rank, world_size)
    pe, n = lib.my_pe(), lib.n_pes()
    if (pe, n) != (rank, world_size):
        raise TopologyError(
            f"NVSHMEM made this process PE {pe} of {n}, expected {rank} of {world_size}: "
            f"the store was shared with another AFD world, or ranks were started twice"
        )
