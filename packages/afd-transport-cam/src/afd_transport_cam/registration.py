"""The CAM emulator's entry in afd's transport registry (``afd_protocol.transports``).

Registered in this package's ``pyproject.toml`` as ``cam-emulator``; the emulator is
imported when a factory is built, not when the transports are listed.
"""

from __future__ import annotations

import functools

from afd_protocol import (
    DeviceSharing,
    SharedPlacement,
    SlotLayout,
    TransportFactory,
    TransportOptions,
    TransportSpec,
)


def _emulator_factory(slot: SlotLayout, options: TransportOptions) -> TransportFactory:
    """:func:`afd_transport_cam.emulated.emulated_connection` with ``options`` bound, after
    :func:`afd_transport_cam.endpoints.cam_geometry` has checked that CAM's operators can
    carry ``slot`` (a :class:`TopologyError` says why not)."""
    from afd_transport_cam.emulated import emulated_connection
    from afd_transport_cam.emulator.world import DEFAULT_SPIN_TIMEOUT
    from afd_transport_cam.endpoints import cam_geometry

    cam_geometry(slot, options.dynamic_quant)
    spin_timeout = DEFAULT_SPIN_TIMEOUT if options.wait_timeout is None else options.wait_timeout
    return functools.partial(
        emulated_connection, dynamic_quant=options.dynamic_quant, spin_timeout=spin_timeout
    )


CAM_EMULATOR_TRANSPORT = TransportSpec(
    name="cam-emulator",
    summary="the CPU emulator of Ascend CAM's compact routed-only operators across processes "
    "(shared experts on the attention side, experts split evenly over the FFN ranks)",
    devices=frozenset({"cpu"}),
    device_sharing=DeviceSharing.FREE,
    requirement="afd-transport-cam",
    build=_emulator_factory,
    shared_placements=frozenset({SharedPlacement.ATTENTION}),
    dynamic_quant=True,
)
"""``cam-emulator``: the operators' semantics in shared memory; ``wait_timeout`` bounds each
operator's spin, ``dynamic_quant`` sends int8 rows with a per-token scale."""
