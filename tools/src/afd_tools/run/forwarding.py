"""The base of ``afd run``'s endpoint wrappers (lockstep, host staging, timing): every call
goes to the wrapped attention endpoint unless a subclass changes it."""

from __future__ import annotations

import torch

from afd_protocol import AttentionEndpoint, DispatchHandle, SharedPlacement


class ForwardingEndpoint:
    """An :class:`~afd_protocol.AttentionEndpoint` that forwards to ``endpoint``."""

    def __init__(self, endpoint: AttentionEndpoint) -> None:
        self.endpoint = endpoint

    @property
    def rank(self) -> int:
        return self.endpoint.rank

    @property
    def dtype(self) -> torch.dtype:
        return self.endpoint.dtype

    @property
    def shared_placement(self) -> SharedPlacement:
        return self.endpoint.shared_placement

    @property
    def in_flight(self) -> int:
        return self.endpoint.in_flight

    def dispatch(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        stage: int = 0,
    ) -> DispatchHandle:
        return self.endpoint.dispatch(layer_idx, hidden_states, topk_ids, topk_weights, stage)

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        return self.endpoint.combine(handle, timeout)

    def announce_shutdown(self) -> None:
        self.endpoint.announce_shutdown()

    def abort(self) -> None:
        self.endpoint.abort()

    def close(self) -> None:
        self.endpoint.close()
