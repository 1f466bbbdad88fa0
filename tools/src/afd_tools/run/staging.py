"""Models on a GPU over a transport whose windows live in host memory.

The shared-memory transport carries rows between processes through host memory, so a
model running on a GPU copies its rows to the host to dispatch and back after combine, and
an FFN rank copies each work item to its GPU and the outputs back. That lets ``afd run
--device cuda --transport shm`` run the main job on GPUs without NVSHMEM (or with several
ranks sharing one GPU, where NVSHMEM would not), verified like every other run; its
timings include those copies, so they say nothing about NVSHMEM's.
"""

from __future__ import annotations

import dataclasses

import torch

from afd_protocol import (
    AttentionEndpoint,
    Compute,
    DispatchHandle,
    WorkItem,
    WorkItemPart,
)
from afd_tools.run.forwarding import DispatchCall, ForwardingEndpoint


class StagedAttentionEndpoint(ForwardingEndpoint):
    """An attention endpoint on ``endpoint_device`` used by a model on ``model_device``."""

    def __init__(
        self, endpoint: AttentionEndpoint, endpoint_device: torch.device, model_device: torch.device
    ) -> None:
        super().__init__(endpoint)
        self.endpoint_device = endpoint_device
        self.model_device = model_device

    def forward_dispatch(self, call: DispatchCall) -> DispatchHandle:
        """Dispatch the call's tensors from the endpoint's device."""
        return super().forward_dispatch(call.to(self.endpoint_device))

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        return self.endpoint.combine(handle, timeout).to(self.model_device)


def part_on(part: WorkItemPart, device: torch.device) -> WorkItemPart:
    """``part`` with every tensor copied to ``device``."""
    moved = {
        f.name: getattr(part, f.name).to(device)
        for f in dataclasses.fields(part)
        if isinstance(getattr(part, f.name), torch.Tensor)
    }
    return dataclasses.replace(part, **moved)


def staged_compute(
    compute: Compute, device: torch.device, endpoint_device: torch.device
) -> Compute:
    """Wrap an FFN executor's ``compute(item) -> (routed, shared)`` so that it sees the
    item on ``device`` and returns its outputs on ``endpoint_device``."""

    def run(item: WorkItem) -> tuple[torch.Tensor, torch.Tensor | None]:
        moved = dataclasses.replace(item, parts=tuple(part_on(p, device) for p in item.parts))
        routed, shared = compute(moved)
        return routed.to(endpoint_device), (None if shared is None else shared.to(endpoint_device))

    return run
