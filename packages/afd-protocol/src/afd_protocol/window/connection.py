"""A window transport as a :class:`~afd_protocol.core.endpoints.Connection`.

What a launcher hands to a rank program when the backend is a window transport (shared
memory, NVSHMEM, the loopback): a :class:`WindowConnection` owns one rank's
:class:`~afd_protocol.window.transport.WindowTransport` and makes this rank's endpoint over
it. The layers stay one way: the transport interface knows nothing of endpoints, the
endpoints know only the transport interface, and this module, above both, picks which
endpoint a rank gets.

Which endpoint is the backend's choice, declared by the device kernels it offers
(:class:`~afd_protocol.window.kernels.WindowKernels`): none gives the portable
:class:`~afd_protocol.window.attention.WindowAttentionEndpoint` and
:class:`~afd_protocol.window.ffn.WindowFFNEndpoint`; kernels give the
:class:`~afd_protocol.window.kernel_attention.KernelAttentionEndpoint` with them, and the
FFN endpoint with their ``per_rank`` reduce. Pass them to the constructor, or override
:meth:`WindowConnection.endpoint_kernels` to load them only when an endpoint is made (the
NVSHMEM transport's connection does, so Triton loads then).

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
from afd_protocol.window.kernel_attention import KernelAttentionEndpoint
from afd_protocol.window.kernels import WindowKernels
from afd_protocol.window.transport import WindowTransport


class WindowConnection:
    """One rank's connection over ``transport``; see the module docstring.

    ``kernels``: the device kernels its endpoints use (None: the portable endpoints).
    """

    def __init__(self, transport: WindowTransport, kernels: WindowKernels | None = None) -> None:
        self.transport = transport
        """The byte-moving backend (windows, flags, abort words); this connection owns it."""
        self._kernels = kernels

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

    def endpoint_kernels(self) -> WindowKernels | None:
        """The device kernels of the endpoints made from now on (the hook a backend overrides)."""
        return self._kernels

    def attention_endpoint(self, options: EndpointOptions | None = None) -> WindowAttentionEndpoint:
        """This attention rank's endpoint: with the backend's kernels when it has them."""
        kernels = self.endpoint_kernels()
        if kernels is None:
            return WindowAttentionEndpoint(self.transport, options)
        return KernelAttentionEndpoint(self.transport, options, kernels)

    def ffn_endpoint(self, options: EndpointOptions | None = None) -> WindowFFNEndpoint:
        """This FFN rank's endpoint (its ``per_rank`` parts reduce with the kernels' reduce)."""
        return WindowFFNEndpoint(self.transport, options, self.endpoint_kernels())

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
