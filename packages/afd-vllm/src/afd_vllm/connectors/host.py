"""``HostAsyncAFDConnector``: afd's windows in host shared memory (CPU; one machine)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from afd_protocol import Connection, ShmTransport
from afd_vllm.connectors.base import AFDConnector
from afd_vllm.extra import HostExtraConfig


class HostAsyncAFDConnector(AFDConnector):
    name = "HostAsyncAFDConnector"

    def rendezvous_dir(self) -> Path:
        """``connector_extra_config.rendezvous_dir``, or one directory per port under the
        temporary directory (both roles compute the same one)."""
        extra = self.config.extra
        assert isinstance(extra, HostExtraConfig)
        if extra.rendezvous_dir:
            return Path(extra.rendezvous_dir)
        return Path(tempfile.gettempdir()) / f"afd-vllm-{self.config.port}"

    def connect(self, rank: int, connect_timeout: float = 60.0) -> Connection:
        folder = self.rendezvous_dir()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return ShmTransport(self.window(), self.role, rank, folder, connect_timeout=connect_timeout)
