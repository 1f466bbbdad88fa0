"""The base of ``afd run``'s endpoint wrappers (lockstep, host staging, timing): every call
goes to the wrapped attention endpoint unless a subclass changes it.

The protocol's ``dispatch(layer_idx, hidden_states, topk_ids, topk_weights, stage)`` is
written here once: it packs its arguments into a :class:`DispatchCall` and hands it to
:meth:`ForwardingEndpoint.forward_dispatch`, the one method a wrapper overrides to wait
before the call, move its tensors or time it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from afd_protocol import AttentionEndpoint, DispatchHandle, SharedPlacement


@dataclass(frozen=True)
class DispatchCall:
    """The arguments of one :meth:`afd_protocol.AttentionEndpoint.dispatch` (shapes and
    dtypes as documented there: ``hidden_states [T, H]``, ``topk_ids`` / ``topk_weights``
    ``[T, k]``)."""

    layer_idx: int
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    stage: int = 0

    def to(self, device: torch.device) -> DispatchCall:
        """The same call with its three tensors copied to ``device``."""
        return dataclasses.replace(
            self,
            hidden_states=self.hidden_states.to(device),
            topk_ids=self.topk_ids.to(device),
            topk_weights=self.topk_weights.to(device),
        )

    def on(self, endpoint: AttentionEndpoint) -> DispatchHandle:
        """Make the call on ``endpoint``."""
        return endpoint.dispatch(
            self.layer_idx, self.hidden_states, self.topk_ids, self.topk_weights, self.stage
        )


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
        """The protocol's dispatch, as one :class:`DispatchCall` to
        :meth:`forward_dispatch` (override that, not this)."""
        return self.forward_dispatch(
            DispatchCall(layer_idx, hidden_states, topk_ids, topk_weights, stage)
        )

    def forward_dispatch(self, call: DispatchCall) -> DispatchHandle:
        """Pass ``call`` on to the wrapped endpoint (a wrapped wrapper takes the same call
        object: one :class:`DispatchCall` per dispatch through the whole chain)."""
        if isinstance(self.endpoint, ForwardingEndpoint):
            return self.endpoint.forward_dispatch(call)
        return call.on(self.endpoint)

    def combine(self, handle: DispatchHandle, timeout: float | None = None) -> torch.Tensor:
        return self.endpoint.combine(handle, timeout)

    def announce_shutdown(self) -> None:
        self.endpoint.announce_shutdown()

    def abort(self) -> None:
        self.endpoint.abort()

    def close(self) -> None:
        self.endpoint.close()
