"""``GpuAsyncAFDConnector``: afd's windows in NVSHMEM memory between GPUs of one node.

Needs ``pip install afd-vllm[cuda]`` (the NVSHMEM transport and library)."""

from __future__ import annotations

from afd_protocol import Connection, TcpStore
from afd_transport_nvshmem.transport import NvshmemConnection, NvshmemTransport
from afd_vllm.connectors.base import AFDConnector


class GpuAsyncAFDConnector(AFDConnector):
    name = "GpuAsyncAFDConnector"

    def connect(self, rank: int, connect_timeout: float = 60.0) -> Connection:
        layout = self.layout()
        world = layout.topology.world_rank(self.role, rank)
        store = TcpStore(world, layout.topology.world_size, connect_timeout, port=self.config.port)
        return NvshmemConnection(
            NvshmemTransport(self.window(), self.role, rank, store, connect_timeout=connect_timeout)
        )
