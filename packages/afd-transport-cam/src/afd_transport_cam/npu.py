"""Open a rank's connection to the real CAM operators on an Ascend machine.

Written from the operators' published interface and the public AFD connector's set-up
(see the package README); **never run on an NPU here** -- no Ascend machine is available
to this project yet. On a machine without ``torch_npu`` it raises
:class:`~afd_transport_cam.binding.CamUnavailable` before touching anything.

Set-up, as the public connector does it: one HCCL process group over the whole attention +
FFN world (``world_size = A + F``, attention ranks first), joined through a TCP
``init_method``; the CAM operators address their windows through the group's HCCL
communicator name, which is what the endpoints pass as ``group_name``.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from afd_protocol import Role, SlotLayout
from afd_transport_cam.binding import load_npu_operators
from afd_transport_cam.endpoints import CamConnection

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""The public connector's rendezvous timeout for the HCCL group."""


class _ProcessGroupLink:
    """Destroys the HCCL group on close (the operators keep no other state)."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def abort(self) -> None:
        """HCCL has no abort word: peers' operators would spin (their timeouts are HCCL's)."""

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group(self._group)


def npu_connection(
    layout: SlotLayout,
    role: Role | str,
    rank: int,
    init_method: str,
    *,
    local_rank: int,
    dynamic_quant: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> CamConnection:
    """This rank's connection over the real operators on NPU ``local_rank``."""
    operators = load_npu_operators()  # CamUnavailable here, before any side effect
    import torch.distributed as dist

    topology = layout.topology
    world_rank = topology.world_rank(Role(role), rank)
    device = torch.device("npu", local_rank)
    torch.npu.set_device(device)  # type: ignore[attr-defined]
    if not dist.is_initialized():
        dist.init_process_group(
            "hccl",
            init_method=init_method,
            world_size=topology.world_size,
            rank=world_rank,
            timeout=timeout,
        )
    group = dist.new_group(list(range(topology.world_size)), backend="hccl", timeout=timeout)
    group_name = group._get_backend(device).get_hccl_comm_name(world_rank)
    return CamConnection(
        layout,
        role,
        rank,
        group_name,
        dynamic_quant=dynamic_quant,
        link=_ProcessGroupLink(group),
        operators=operators,
        device=device,
    )
