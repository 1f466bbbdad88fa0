"""Open a rank's connection to an emulated CAM communicator across processes.

:func:`emulated_connection` has the signature of :data:`afd_protocol.launch.
TransportFactory`, so ``launch(..., transport_factory=emulated_connection)`` (or a
``functools.partial`` of it with ``dynamic_quant`` / ``spin_timeout``) runs any afd rank
program over the emulator: each rank process maps the windows (:class:`~afd_transport_cam.
emulator.shm_world.ShmCamWorld`), registers them under a communicator name of its own and
gets a :class:`~afd_transport_cam.endpoints.CamConnection` that unregisters and unmaps on
close.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from afd_protocol import Role, WindowLayout
from afd_transport_cam.emulator.shm_world import ShmCamWorld
from afd_transport_cam.emulator.world import (
    DEFAULT_SPIN_TIMEOUT,
    register_world,
    unregister_world,
)
from afd_transport_cam.endpoints import CamConnection, cam_geometry


class _RegisteredWorld:
    """The windows and their registry entry, released together."""

    def __init__(self, world: ShmCamWorld, group_name: str) -> None:
        self._world = world
        self._group = group_name

    def abort(self) -> None:
        self._world.abort()

    def close(self) -> None:
        unregister_world(self._group)
        self._world.close()


def emulated_connection(
    window: WindowLayout,
    role: Role,
    rank: int,
    rendezvous: str | Path,
    connect_timeout: float,
    *,
    dynamic_quant: bool = False,
    spin_timeout: float = DEFAULT_SPIN_TIMEOUT,
) -> CamConnection:
    """This rank's connection over the emulated CAM operators (module docstring)."""
    layout = window.slot
    geo = cam_geometry(layout, dynamic_quant)
    world = ShmCamWorld(
        geo, role, rank, rendezvous, connect_timeout=connect_timeout, spin_timeout=spin_timeout
    )
    group = f"afd-cam-emulator-{world.world_rank}-{secrets.token_hex(4)}"
    try:
        register_world(group, world)
    except BaseException:
        world.close()
        raise
    return CamConnection(
        layout,
        role,
        rank,
        group,
        dynamic_quant=dynamic_quant,
        link=_RegisteredWorld(world, group),
    )
