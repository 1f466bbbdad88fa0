"""What every afd connector does: from the plugin's settings and the model's geometry to an
open :class:`~afd_protocol.Connection` (the window layout, the rank, the rendezvous)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from afd_protocol import (
    CombineReduce,
    Connection,
    EndpointOptions,
    Role,
    SharedPlacement,
    SlotLayout,
    Topology,
    WindowLayout,
    WireFormat,
)
from afd_vllm.config import AFDConfig
from afd_vllm.extra import WindowExtraConfig


@dataclass(frozen=True)
class ModelGeometry:
    """What the connector needs to know of the model and the engine."""

    hidden_size: int
    num_experts: int
    topk: int
    num_layers: int
    max_num_batched_tokens: int
    dtype: str
    """``float32``, ``bfloat16`` or ``float16``."""


class AFDConnector(abc.ABC):
    """One process's connector (see the module docstring)."""

    name: str = ""

    def __init__(self, config: AFDConfig, geometry: ModelGeometry) -> None:
        self.config = config
        self.geometry = geometry

    @property
    def role(self) -> Role:
        return Role.ATTENTION if self.config.is_attention else Role.FFN

    def layout(self) -> SlotLayout:
        """The deployment's geometry, which both roles must agree on (compared at start-up)."""
        c, g = self.config, self.geometry
        extra = c.extra
        topology = Topology(
            c.num_attention_ranks, c.num_ffn_ranks, g.num_experts, extra.attn_ranks_per_dp
        )
        window_settings: dict[str, object] = {}
        if isinstance(extra, WindowExtraConfig):
            window_settings = {
                "routed_cap_multiplier": extra.routed_cap_multiplier,
                "wire_format": WireFormat(extra.wire_format),
                "combine_reduce": CombineReduce(extra.combine_reduce),
            }
        return SlotLayout(
            topology,
            g.hidden_size,
            g.max_num_batched_tokens,
            g.topk,
            dtype=g.dtype,
            shared_placement=SharedPlacement.ATTENTION,
            **window_settings,  # type: ignore[arg-type]
        )

    def window(self) -> WindowLayout:
        extra = self.config.extra
        depth = extra.ring_depth if isinstance(extra, WindowExtraConfig) else extra.num_stages
        return self.layout().window(ring_depth=max(depth, extra.num_stages))

    def endpoint_options(self) -> EndpointOptions:
        extra = self.config.extra
        return EndpointOptions(
            timeout=extra.recv_poll_timeout_ms / 1e3,
            num_layers=self.geometry.num_layers,
            num_stages=extra.num_stages,
        )

    @abc.abstractmethod
    def connect(self, rank: int, connect_timeout: float = 60.0) -> Connection:
        """Open this process's connection as ``rank`` of its role (blocks until every peer
        joined, or raises naming who is missing)."""
