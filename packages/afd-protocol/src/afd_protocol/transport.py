"""The transport interface: the few operations a backend provides to the endpoints.

A transport owns one rank's *window* (a buffer its opposite-role peers write into) and
maps the windows of its opposite-role peers. The endpoints (:mod:`afd_protocol.endpoints`)
are written once against this interface; a backend only moves bytes and flags:

* :meth:`Transport.local_window` / :meth:`Transport.peer_window` -- flat ``uint8`` tensors
  over this rank's window and a peer's mapped window. Writes into a peer window are
  one-sided (``copy_``/``index_select(out=...)`` into the view).
* :meth:`Transport.publish` -- make every earlier write into a peer's window visible,
  then set one flag word there. A receiver that sees the flag therefore sees a complete
  payload; each backend's docstring states why that holds on its hardware.
* :meth:`Transport.wait_any` -- block until one of a set of this window's flag words
  differs from the value last seen, with a timeout; fail fast if a watched peer set its
  abort word or died.
* :meth:`Transport.read_header` -- the header words of a message that just arrived, on the
  host. The default copies them out of the window; a transport whose wait already brought
  them to the host together with the flag returns that copy, so learning what arrived
  costs no device-to-host copy.
* :meth:`Transport.fused_combine` -- optionally, a device kernel that combines a layer's
  replies in one pass (:mod:`afd_protocol.fused`).
* :meth:`Transport.device_pack` -- optionally, a device kernel that writes a whole dispatch
  without the host reading the counts (:mod:`afd_protocol.device_pack`).
* :meth:`Transport.abort` -- set this rank's abort word in every peer window.
* :meth:`Transport.close` -- release everything; idempotent.

Flag words hold the sender's sequence number, which only grows, so "differs from the
last value seen" is an ABA-safe arrival test with no remote atomics.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import TracebackType

import torch

from afd_protocol.device_pack import DevicePack
from afd_protocol.fused import FusedCombine
from afd_protocol.layout import WindowLayout
from afd_protocol.topology import Role, Topology


class Transport(abc.ABC):
    """One rank's view of the AFD world: its window, its peers' windows, flags, abort."""

    def __init__(self, window: WindowLayout, role: Role, rank: int) -> None:
        self.window = window
        self.role = role
        self.rank = rank
        self.topology.world_rank(role, rank)  # validates the rank

    @property
    def topology(self) -> Topology:
        return self.window.slot.topology

    @property
    def num_peers(self) -> int:
        """Number of opposite-role ranks (the only ranks this one talks to)."""
        return self.topology.num_role_ranks(self.role.opposite)

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where window tensors live; payloads must be on this device."""

    @abc.abstractmethod
    def local_window(self) -> torch.Tensor:
        """This rank's window as a flat uint8 tensor (peers write into it)."""

    @abc.abstractmethod
    def peer_window(self, peer: int) -> torch.Tensor:
        """Opposite-role ``peer``'s window as a flat uint8 tensor (this rank writes into it)."""

    @abc.abstractmethod
    def publish(self, peer: int, flag_index: int, value: int) -> None:
        """Make all earlier writes into ``peer``'s window visible, then set its flag word."""

    @abc.abstractmethod
    def wait_any(
        self,
        flag_indices: Sequence[int],
        last_seen: Sequence[int],
        timeout: float,
        peers: Sequence[int],
    ) -> list[int]:
        """Wait until a local flag word differs from its last-seen value.

        Returns the current values of ``flag_indices`` (at least one differs). Raises
        :class:`~afd_protocol.errors.PeerAborted` when one of ``peers`` set its abort word
        or died, :class:`~afd_protocol.errors.PeerTimeout` after ``timeout`` seconds.
        """

    def read_header(self, flag_index: int, value: int, header: torch.Tensor) -> torch.Tensor:
        """Header words (host int32) of the message that set local flag ``flag_index`` to ``value``.

        ``header`` is that slot's header field in :meth:`local_window`. The sender does not
        reuse the slot before it gets an answer, so the words stay valid until this rank
        answers. Transports override this when their :meth:`wait_any` captured the header.
        """
        del flag_index, value
        return header if header.device.type == "cpu" else header.cpu()

    def fused_combine(self) -> FusedCombine | None:
        """A kernel that combines a layer's replies in one pass on this transport's device.

        None (the default) makes the attention endpoint use the portable per-FFN-rank
        :func:`~afd_protocol.plan.combine_scatter`.
        """
        return None

    def device_pack(self) -> DevicePack | None:
        """A kernel that writes a whole dispatch, rows and headers, from a device-side plan.

        None (the default) makes the attention endpoint read the counts to the host and
        write each FFN rank's rows itself. Used only together with :meth:`fused_combine`.
        """
        return None

    @abc.abstractmethod
    def abort(self) -> None:
        """Tell every peer that this rank failed (sets its abort word in their windows)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the window and the peer mappings. Safe to call twice."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            self.abort()
        self.close()
