"""What the attention and FFN endpoints share: role check, geometry handles, header writes."""

from __future__ import annotations

from typing import ClassVar

import torch

from afd_protocol.errors import TopologyError
from afd_protocol.header import FLAG_SHUTDOWN, Header, MessageKind
from afd_protocol.layout import SlotLayout
from afd_protocol.staging import HeaderStaging
from afd_protocol.topology import Role
from afd_protocol.transport import Transport
from afd_protocol.views import SlotView, torch_dtype


class EndpointBase:
    """Common state of an endpoint bound to one transport of the matching role."""

    role: ClassVar[Role]

    def __init__(self, transport: Transport, timeout: float) -> None:
        if transport.role is not self.role:
            raise TopologyError(
                f"{type(self).__name__} needs a transport opened with role {self.role.value}"
            )
        if timeout <= 0:
            raise TopologyError(f"timeout must be > 0 seconds, got {timeout}")
        self._transport = transport
        self._window = transport.window
        self._slot: SlotLayout = self._window.slot
        self._topology = self._slot.topology
        self._rank = transport.rank
        self._timeout = timeout
        if self._slot.payload_dtype is not None:
            raise TopologyError(
                f"payload_dtype={self._slot.payload_dtype!r}: low-precision payloads are laid out "
                f"but not yet sent by the endpoints; use payload_dtype=None"
            )
        self._seq = 0
        self._shutdown_announced = False
        self._staging = HeaderStaging(transport.device)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype of the rows on the wire."""
        return torch_dtype(self._slot.dtype)

    def _next_seq(self) -> int:
        """This rank's next message sequence number (flags only ever grow: ABA-safe)."""
        self._seq += 1
        return self._seq

    def _shutdown_header(self, kind: MessageKind, ffn_rank: int) -> Header:
        """An empty message with the shutdown bit, sized for ``ffn_rank``'s expert counts."""
        seq = self._next_seq()
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
        self._staging.write(view.header, header, (peer, ring))
        self._transport.publish(peer, self._window.flag_index(self._rank, ring), header.seq)

    def abort(self) -> None:
        """Tell every peer this rank failed (its waits then raise PeerAborted)."""
        self._transport.abort()
