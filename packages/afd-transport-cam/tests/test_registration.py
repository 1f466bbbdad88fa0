"""This package's entry in afd's transport registry: ``cam-emulator`` on CPU ranks, routed
experts only, and the launcher factory it builds (the geometry checked first)."""

from __future__ import annotations

import functools

import pytest

from afd_protocol import (
    DeviceSharing,
    InvalidArgument,
    SharedPlacement,
    SlotLayout,
    Topology,
    TopologyError,
    TransportOptions,
    get_transport,
)
from afd_transport_cam.emulated import emulated_connection
from afd_transport_cam.emulator.world import DEFAULT_SPIN_TIMEOUT
from afd_transport_cam.registration import CAM_EMULATOR_TRANSPORT


def slot(experts: int = 8, shared: str = "attention") -> SlotLayout:
    return SlotLayout(Topology(2, 2, experts), 64, 16, 2, dtype="float32", shared_placement=shared)


def test_cam_emulator_is_registered_for_cpu_ranks_with_shared_experts_on_attention() -> None:
    cam = get_transport("cam-emulator")
    assert cam is CAM_EMULATOR_TRANSPORT
    assert cam.devices == {"cpu"}
    assert cam.device_sharing is DeviceSharing.FREE
    assert cam.shared_placements == {SharedPlacement.ATTENTION}
    assert cam.requirement == "afd-transport-cam"
    assert cam.dynamic_quant
    with pytest.raises(InvalidArgument, match="transport cam-emulator needs device cpu"):
        cam.check_device("cuda")


def test_the_factory_binds_the_options_to_the_emulated_connection() -> None:
    options = TransportOptions(wait_timeout=7.5, dynamic_quant=True)
    factory = CAM_EMULATOR_TRANSPORT.factory(slot(), options)
    assert isinstance(factory, functools.partial)
    assert factory.func is emulated_connection
    assert factory.keywords == {"dynamic_quant": True, "spin_timeout": 7.5}
    default = CAM_EMULATOR_TRANSPORT.factory(slot())
    assert isinstance(default, functools.partial)
    assert default.keywords == {"dynamic_quant": False, "spin_timeout": DEFAULT_SPIN_TIMEOUT}


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (slot(shared="ffn"), "carry routed experts only"),
        (slot(experts=5), "must split evenly and contiguously over the 2 FFN ranks"),
    ],
)
def test_the_factory_refuses_a_geometry_cam_cannot_carry(layout: SlotLayout, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        CAM_EMULATOR_TRANSPORT.factory(layout)
