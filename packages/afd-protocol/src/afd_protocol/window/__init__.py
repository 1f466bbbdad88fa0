"""The window layer: AFD over windows that peers write into, with flags and abort words.

Above the contract core, bottom to top (``import-linter`` keeps the direction): a
bytes-and-flags transport interface (:class:`WindowTransport`); the window endpoints that
implement the core's endpoint protocols over it (:class:`WindowAttentionEndpoint`,
:class:`WindowFFNEndpoint`; a backend with device kernels extends them in its own package);
:class:`WindowConnection`, the :class:`~afd_protocol.core.endpoints.Connection` that owns a
transport and makes the endpoint a rank asks for; and an in-process loopback transport for
step-by-step tests. The shared-memory transport (:mod:`afd_protocol.shm`) and the NVSHMEM
transport build on it.
"""

from afd_protocol.window.attention import ExpectedReply, WindowAttentionEndpoint, WindowDispatch
from afd_protocol.window.connection import WindowConnection
from afd_protocol.window.ffn import WindowFFNEndpoint
from afd_protocol.window.loopback import LoopbackTransport, LoopbackWorld
from afd_protocol.window.options import WindowOptions
from afd_protocol.window.pinned import HeaderUpload, PinnedReadback, PinnedUpload
from afd_protocol.window.transport import (
    Arrivals,
    PublishBlock,
    SequenceCounter,
    TensorPublishBlock,
    WindowTransport,
)
from afd_protocol.window.views import SlotView, abort_words, flag_words, slot_view

__all__ = [
    "Arrivals",
    "ExpectedReply",
    "HeaderUpload",
    "LoopbackTransport",
    "LoopbackWorld",
    "PinnedReadback",
    "PinnedUpload",
    "PublishBlock",
    "SequenceCounter",
    "SlotView",
    "TensorPublishBlock",
    "WindowAttentionEndpoint",
    "WindowConnection",
    "WindowDispatch",
    "WindowFFNEndpoint",
    "WindowOptions",
    "WindowTransport",
    "abort_words",
    "flag_words",
    "slot_view",
]
