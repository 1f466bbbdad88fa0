"""The connection of a rank that has no FFN peer: what the colocated baselines of ``afd run``
hand their rank programs.

The launcher opens an :class:`afd_protocol.Connection` for every rank; the colocated
baselines (``--colocated mono``, :mod:`afd_tools.run.monolithic`; ``--colocated dp-ep``,
:mod:`afd_tools.run.expert_parallel`) have attention ranks only, and no transport to an
FFN role. :class:`PeerlessConnection` is what they share: an attention rank, its number,
the deployment's slot layout and the rank's device, no FFN endpoint, no peer to tell of a
failure and nothing held. A subclass makes the attention endpoint (or refuses to) and
releases what it opened.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from afd_protocol import (
    AttentionEndpoint,
    EndpointOptions,
    InvalidArgument,
    RankConnection,
    Role,
    WindowLayout,
)


class PeerlessConnection(RankConnection):
    """An attention rank's :class:`~afd_protocol.Connection` without FFN peers: rank
    ``rank`` of the window's slot layout, with its tensors on ``device``."""

    NO_ATTENTION_ENDPOINT: ClassVar[str] = "this rank exchanges nothing: it has no endpoint"
    """Why :meth:`attention_endpoint` refuses where a subclass does not make one (the
    :class:`~afd_protocol.InvalidArgument`'s message)."""
    NO_FFN_ENDPOINT: ClassVar[str] = "this rank has no FFN role"
    """Why :meth:`ffn_endpoint` refuses."""

    def __init__(self, window: WindowLayout, rank: int, device: torch.device) -> None:
        super().__init__(window.slot, Role.ATTENTION, rank, device)

    def attention_endpoint(self, options: EndpointOptions | None = None) -> AttentionEndpoint:
        """This rank's endpoint, where a subclass makes one (here: ``InvalidArgument``)."""
        raise InvalidArgument(self.NO_ATTENTION_ENDPOINT)

    def ffn_endpoint(self, options: EndpointOptions | None = None) -> Any:
        raise InvalidArgument(self.NO_FFN_ENDPOINT)

    def abort(self) -> None:
        """No peer to tell."""

    def close(self) -> None:
        """Nothing held."""
