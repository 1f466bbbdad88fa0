"""Bootstrapping NVSHMEM ourselves, through any key-value store.

The AFD world is two independent role groups, so NVSHMEM is not initialised through a
torch process group: rank 0 makes a unique id, publishes it in a store (a
``torch.distributed.TCPStore`` on 127.0.0.1, a rendezvous directory, or any object with
``set``/``get``), every rank initialises with it, and the AFD world *is*
``NVSHMEM_TEAM_WORLD`` -- PE numbers equal AFD world ranks, which is asserted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

from afd_protocol import PeerTimeout, TopologyError
from afd_transport_nvshmem.binding import NvshmemLibrary

SINGLE_NODE_DEFAULTS: Mapping[str, str] = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",  # one node: NVLink/P2P only, no network transport
    "NVSHMEM_DISABLE_NVLS": "1",  # no NVLink multicast (it can take shared GPUs down)
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",  # bootstrap on loopback only
    "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY": "AF_INET",
}
HEAP_MARGIN = 512 << 20
"""Symmetric heap reserved beyond the window (NVSHMEM's own internal allocations)."""


class KeyValueStore(Protocol):
    """What the transport needs from a store: ``get`` blocks until the key exists (up to
    the store's timeout); ``check`` tells without blocking whether all keys exist."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


DEFAULT_STORE_PORT = 29517
ENV_STORE_PORT = "AFD_NVSHMEM_STORE_PORT"


class TcpStore:
    """The default store: a ``torch.distributed.TCPStore`` on 127.0.0.1 hosted by world
    rank 0, on port ``AFD_NVSHMEM_STORE_PORT`` (default 29517); timeouts become
    :class:`PeerTimeout`."""

    def __init__(self, world_rank: int, world_size: int, timeout: float = 60.0) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, re-exported

        self.port = int(os.environ.get(ENV_STORE_PORT, DEFAULT_STORE_PORT))
        self._timeout = timeout
        try:
            self._store = TCPStore(
                "127.0.0.1",
                self.port,
                world_size,
                is_master=world_rank == 0,
                timeout=timedelta(seconds=timeout),
            )
        except RuntimeError as exc:
            raise PeerTimeout(
                f"cannot reach or host the store on 127.0.0.1:{self.port} ({exc}); set "
                f"{ENV_STORE_PORT} to a free port, the same on every rank"
            ) from exc

    def set(self, key: str, value: bytes) -> None:
        # TCPStore takes bytes at run time (its stub says str); a str would be UTF-8 encoded.
        self._store.set(key, value)  # type: ignore[arg-type]

    def check(self, keys: list[str]) -> bool:
        return bool(self._store.check(keys))

    def get(self, key: str) -> bytes:
        try:
            return bytes(self._store.get(key))
        except RuntimeError as exc:
            raise PeerTimeout(
                f"store key {key!r} did not appear within {self._timeout:g} s on "
                f"127.0.0.1:{self.port}"
            ) from exc


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
