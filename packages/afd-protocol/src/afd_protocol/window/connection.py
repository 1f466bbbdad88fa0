"""A window transport as a :class:`~afd_protocol.core.endpoints.Connection`.

What a launcher hands to a rank program when the backend is a window transport (shared
memory, NVSHMEM, the loopback): a :class:`WindowConnection` owns one rank's
:class:`~afd_protocol.window.transport.WindowTransport` and makes this rank's endpoint over
it. The layers stay one way: the transport interface knows nothing of endpoints, the
endpoints know only the transport interface, and this module, above both, picks which
endpoint a rank gets.

A backend with device kernels subclasses it and makes its own endpoints (the NVSHMEM
transport's connection makes its kernel attention endpoint and gives the FFN endpoint its
reduce kernel); this one makes the portable
:class:`~afd_protocol.window.attention.WindowAttentionEndpoint` and
:class:`~afd_protocol.window.ffn.WindowFFNEndpoint`.

The window's state -- the sequence counter, the flag values last consumed, the one endpoint
bound to it -- belongs to the transport, so closing an endpoint and asking for another is
cheap, and only one endpoint uses the window at a time. ``abort()`` and ``close()`` reach the
transport; ``with connection:`` aborts on an exception (not on Ctrl-C) and always closes.
"""

from __future__ import annotations

from types import TracebackType

import torch

from afd_protocol.core.endpoints import EndpointOptions
from afd_protocol.core.layout import SlotLayout
from afd_protocol.core.topology import Role
from afd_protocol.window.attention import WindowAttentionEndpoint
from afd_protocol.window.ffn import WindowFFNEndpoint
from afd_protocol.window.transport import WindowTransport


class WindowConnection:
    """One rank's connection over ``transport``; see the module docstring."""

    def __init__(self, transport: WindowTransport) -> None:
        self.transport = transport
        """The byte-moving backend (windows, flags, abort words); this connection owns it."""

    @property
    def role(self) -> Role:
        return self.transport.role

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def layout(self) -> SlotLayout:
        return self.transport.layout

    @property
    def device(self) -> torch.device:
        return self.transport.device

    def attention_endpoint(self, options: EndpointOptions | None = None) -> WindowAttentionEndpoint:
        """This attention rank's endpoint."""
        return WindowAttentionEndpoint(self.transport, options)

    def ffn_endpoint(self, options: EndpointOptions | None = None) -> WindowFFNEndpoint:
        """This FFN rank's endpoint."""
        return WindowFFNEndpoint(self.transport, options)

    def abort(self) -> None:
        """Tell every peer that this rank failed (the transport's abort words)."""
        self.transport.abort()

    def close(self) -> None:
        """Close the transport (idempotent)."""
        self.transport.close()

    def __enter__(self) -> WindowConnection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.transport.__exit__(exc_type, exc, tb)  # abort on an error (not Ctrl-C), close
