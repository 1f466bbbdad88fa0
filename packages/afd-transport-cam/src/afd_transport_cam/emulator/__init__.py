"""A CPU emulator of CAM's compact routed-only operators (generation G2).

:mod:`.ops` implements the four communication operators with their published schemas and
documented semantics over windows found through :mod:`.world`; :mod:`.library` registers
them as ``torch.ops.afd_ascend.*`` CPU operators. See :mod:`.ops` for what the emulator
cannot reproduce.
"""

from afd_transport_cam.emulator.library import register_emulated_ops
from afd_transport_cam.emulator.ops import (
    afd_async_combine_recv,
    afd_async_combine_send,
    afd_async_dispatch_recv,
    afd_async_dispatch_send,
)
from afd_transport_cam.emulator.world import (
    CamWorld,
    LocalCamWorld,
    register_world,
    unregister_world,
    world_for,
)

__all__ = [
    "CamWorld",
    "LocalCamWorld",
    "afd_async_combine_recv",
    "afd_async_combine_send",
    "afd_async_dispatch_recv",
    "afd_async_dispatch_send",
    "register_emulated_ops",
    "register_world",
    "unregister_world",
    "world_for",
]
