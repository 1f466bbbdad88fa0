"""``CAMAsyncAFDConnector``: Ascend CAM's compact routed-only operators (NPU).

Needs ``pip install afd-vllm[ascend]`` (the CAM transport, vllm-ascend and its torch-npu)
and CANN with the CAM operator package; without an NPU, afd's CPU emulator of the same
operators runs the same code (``afd run --transport cam-emulator``)."""

from __future__ import annotations

import datetime

from afd_protocol import Connection
from afd_transport_cam.npu import npu_connection
from afd_vllm.connectors.base import AFDConnector
from afd_vllm.extra import CamExtraConfig


class CAMAsyncAFDConnector(AFDConnector):
    name = "CAMAsyncAFDConnector"

    def connect(self, rank: int, connect_timeout: float = 60.0) -> Connection:
        extra = self.config.extra
        assert isinstance(extra, CamExtraConfig)
        return npu_connection(
            self.layout(),
            self.role,
            rank,
            f"tcp://{self.config.host}:{self.config.port}",
            local_rank=rank,
            dynamic_quant=bool(extra.dynamicQuant),
            timeout=datetime.timedelta(seconds=connect_timeout),
        )
