"""What the attention and FFN window endpoints share: role check, geometry, header I/O."""

from __future__ import annotations

import collections
from typing import ClassVar

import torch

from afd_protocol.core.endpoints import EndpointOptions
from afd_protocol.core.errors import InvalidArgument, TopologyError
from afd_protocol.core.header import FLAG_SHUTDOWN, Header, MessageKind
from afd_protocol.core.layout import SharedPlacement, SlotLayout
from afd_protocol.core.tensors import torch_dtype
from afd_protocol.core.topology import Role
from afd_protocol.window.options import WindowOptions
from afd_protocol.window.pinned import HeaderUpload
from afd_protocol.window.transport import Arrivals, WindowTransport
from afd_protocol.window.views import SlotView


class WindowEndpoint:
    """Common state of a window endpoint bound to one transport of the matching role.

    Subclasses extend :meth:`_setup` (not ``__init__``): the endpoint binds itself to the
    transport only after every check and every allocation succeeded, so a construction
    that fails leaves the window free for the next attempt.
    """

    role: ClassVar[Role]

    def __init__(self, transport: WindowTransport, options: EndpointOptions | None) -> None:
        if transport.role is not self.role:
            raise InvalidArgument(
                f"{type(self).__name__} needs a transport opened with role {self.role.value}, "
                f"got one opened as {transport.role.value} rank {transport.rank}"
            )
        self.options = WindowOptions.of(options)
        self._transport = transport
        self._window = transport.window
        self._slot: SlotLayout = self._window.slot
        self._topology = self._slot.topology
        self._rank = transport.rank
        self._timeout = self.options.timeout
        if self._slot.payload_dtype is not None:
            raise TopologyError(
                f"payload_dtype={self._slot.payload_dtype!r}: low-precision payloads are laid out "
                f"but not yet sent by the endpoints; use payload_dtype=None"
            )
        self._closed = False
        self._headers = HeaderUpload(transport.device)
        self.header_reads: collections.Counter[str] = collections.Counter()
        """How arrived headers reached the host: ``captured`` by the transport's wait
        together with the flag (no copy) or ``copied`` out of the window."""
        self._setup()
        transport.bind(self)

    def _setup(self) -> None:
        """Check the options and build this endpoint's views and buffers."""

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype of the rows on the wire."""
        return torch_dtype(self._slot.dtype)

    @property
    def shared_placement(self) -> SharedPlacement:
        return self._slot.shared_placement

    @property
    def device(self) -> torch.device:
        return self._transport.device

    def _shutdown_header(self, kind: MessageKind, ffn_rank: int) -> Header:
        """An empty message with the shutdown bit, sized for ``ffn_rank``'s expert counts."""
        seq = self._transport.sequence.next()
        return Header(
            kind,
            src_rank=self._rank,
            layer=0,
            stage=0,
            num_tokens=0,
            routed_rows=0,
            shared_rows=0,
            seq=seq,
            answer_seq=seq if kind is MessageKind.REPLY else 0,
            flags=FLAG_SHUTDOWN,
            expert_counts=(0,) * self._slot.num_local_experts(ffn_rank),
        )

    def _write_and_publish(self, view: SlotView, header: Header, peer: int, ring: int) -> None:
        """Write ``header`` into ``view`` (payload already written), then publish its flag."""
        self._headers.write(view.header, header, (peer, ring))
        self._transport.publish(peer, self._window.flag_index(self._rank, ring), header.seq)

    def _header_words(self, arrivals: Arrivals, flag_index: int, view: SlotView) -> torch.Tensor:
        """The host header words of the message whose flag ``arrivals`` reported.

        The sender does not reuse the slot before it gets an answer, so the window's words
        stay valid until this rank answers; a captured copy saves the device-to-host copy.
        """
        if self.options.capture_headers:
            captured = arrivals.headers.get(flag_index)
            if captured is not None:
                self.header_reads["captured"] += 1
                return captured
        self.header_reads["copied"] += 1
        header = view.header
        return header if header.device.type == "cpu" else header.cpu()

    def abort(self) -> None:
        """Tell every peer this rank failed (its waits then raise PeerAborted)."""
        self._transport.abort()

    @property
    def _shutdown_announced(self) -> bool:
        return self._transport.shutdown_announced

    def _work_in_progress(self) -> int:
        """Messages this endpoint still owes or awaits (none: it may close quietly)."""
        return 0

    def close(self) -> None:
        """Release the window for another endpoint; the transport stays open.

        An endpoint closed with work in progress (dispatches not combined, items not
        answered) leaves replies or requests that nobody will match: it tells its peers it
        failed (``abort``) rather than let them wait, or let a later endpoint on the same
        window take a stale reply.
        """
        if self._closed:
            return
        self._closed = True
        if self._work_in_progress():
            self._transport.abort()
        self._transport.unbind(self)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"this {type(self).__name__} was closed")
