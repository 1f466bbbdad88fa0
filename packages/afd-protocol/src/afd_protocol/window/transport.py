"""The window transport interface: the few operations a byte-moving backend provides.

A window transport owns one rank's *window* (a buffer its opposite-role peers write
into) and maps the windows of its opposite-role peers into this process, so that the
window endpoints (:mod:`afd_protocol.window.attention`, :mod:`afd_protocol.window.ffn`),
written once against this interface, move the bytes themselves with ordinary tensor ops
into those mappings. A backend provides the mappings and the flags:

* :meth:`WindowTransport.local_window` / :meth:`WindowTransport.peer_window` -- flat
  ``uint8`` tensors over this rank's window and a peer's mapped window. Writes into a peer
  window are one-sided (``copy_``/``index_select(out=...)`` into the view).
* :meth:`WindowTransport.publish` -- make every earlier write into a peer's window
  visible, then set one flag word there. A receiver that sees the flag therefore sees a
  complete payload; each backend's docstring states why that holds on its hardware.
* :meth:`WindowTransport.wait_any` -- block until one of a set of this window's flag
  words differs from the value last seen, with a timeout; fail fast if a watched peer set
  its abort word or died. A backend whose wait brings the arrived slots' headers to the
  host together with the flags returns them in :class:`Arrivals`, so learning what
  arrived costs no further copy.
* :meth:`WindowTransport.abort` -- set this rank's abort word in every peer window.
* :meth:`WindowTransport.close` -- release everything; idempotent.

Flag words hold the sender's sequence number (:class:`SequenceCounter`), and consecutive
messages into one slot never carry the same one, so "differs from the last value seen"
is an ABA-safe arrival test with no remote atomics. The counter and the values last seen
belong to the transport, not to an endpoint, so an endpoint can be closed and another
opened on the same window (a benchmark comparing endpoint options does this).

A transport knows nothing of endpoints: the endpoints know it, and
:class:`~afd_protocol.window.connection.WindowConnection`, above both, is the
:class:`~afd_protocol.core.endpoints.Connection` a rank program holds -- it owns a transport
and makes this rank's endpoint over it (the portable window endpoints, or those with the
device kernels a backend offers, as the NVSHMEM transport's connection does). The
transport keeps what outlives one endpoint, and lets one endpoint at a time use the window
(:meth:`WindowTransport.bind`).

This layer is for backends with load/store access to their peers' memory (shared memory
on one machine, NVLink peer mappings on one node). A backend without it -- NVSHMEM across
nodes, where ``nvshmem_ptr`` is NULL and writes must be puts with a signal, or Ascend's
CAM operators, which own the whole exchange -- implements the endpoint protocols of
:mod:`afd_protocol.core.endpoints` directly.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import torch

from afd_protocol.core.errors import InvalidArgument
from afd_protocol.core.header import next_seq
from afd_protocol.core.layout import SlotLayout, WindowLayout
from afd_protocol.core.topology import Role, Topology
from afd_protocol.window.views import flag_words


class SequenceCounter:
    """This rank's message sequence numbers: 1, 2, ..., ``2**31 - 1``, then 1 again.

    ``last`` is the number most recently handed out (0: none yet).
    """

    def __init__(self, last: int = 0) -> None:
        self.last = last

    def next(self) -> int:
        self.last = next_seq(self.last)
        return self.last


@dataclass(frozen=True)
class Arrivals:
    """What :meth:`WindowTransport.wait_any` saw."""

    values: list[int]
    """The current value of every watched flag, in the order they were asked for."""
    headers: Mapping[int, torch.Tensor] = field(default_factory=dict)
    """Flag index -> that slot's header words (host int32), captured together with the flag
    value returned (empty when the backend does not capture). Read them before the next
    ``wait_any``: a backend may reuse its capture buffer."""


class PublishBlock(abc.ABC):
    """Several peers' flag words set from values held in memory, by one enqueued operation.

    :meth:`write` puts the next values into the block (host memory: a few microseconds);
    :meth:`launch` enqueues, on the current stream, the operation that reads them *when it
    runs* and stores each into its flag, after everything earlier on the stream. Since the
    operation's arguments never change, a CUDA graph can capture :meth:`launch` once and
    every replay publishes what was last written. Write again only once the previous
    launch has run: the window protocol does (a slot is published again only after its
    answer arrived, which the launch preceded)."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """How many flags one launch sets (one value each)."""

    @abc.abstractmethod
    def write(self, values: Sequence[int]) -> None:
        """The values the next launch (or replay) stores, one per flag."""

    @abc.abstractmethod
    def launch(self) -> None:
        """Enqueue the stores on the current stream (capturable in a CUDA graph)."""

    def prepare(self) -> None:  # noqa: B027 - optional, not abstract
        """Load whatever :meth:`launch` needs (a kernel), publishing nothing, and return when
        that is done: call it before capturing :meth:`launch` (a capture cannot load code).
        Nothing to do by default."""

    def _check(self, values: Sequence[int]) -> None:
        if len(values) != self.size:
            raise InvalidArgument(
                f"this publish block sets {self.size} flags, one value each; got {len(values)}"
            )


class TensorPublishBlock(PublishBlock):
    """A :class:`PublishBlock` of tensor copies: the values go to the device through a
    host buffer (page-locked on an accelerator), then into each flag with ``copy_``.
    Ordered by the stream only -- for windows that the publishing stream's device writes
    and reads itself (see :meth:`WindowTransport.publish_block`)."""

    def __init__(self, targets: Sequence[torch.Tensor], device: torch.device) -> None:
        if not targets:
            raise InvalidArgument("a publish block needs at least one flag")
        self._targets = list(targets)
        pinned = device.type != "cpu"
        self._host = torch.zeros(len(targets), dtype=torch.int32, pin_memory=pinned)
        self._words = (ctypes.c_int32 * len(targets)).from_address(self._host.data_ptr())
        self._device_values = torch.zeros(len(targets), dtype=torch.int32, device=device)

    @property
    def size(self) -> int:
        return len(self._targets)

    def write(self, values: Sequence[int]) -> None:
        self._check(values)
        self._words[:] = list(values)

    def launch(self) -> None:
        self._device_values.copy_(self._host, non_blocking=True)
        for i, flag in enumerate(self._targets):
            flag.copy_(self._device_values[i])


class WindowTransport(abc.ABC):
    """One rank's view of the AFD world: its window, its peers' windows, flags, abort."""

    def __init__(self, window: WindowLayout, role: Role, rank: int) -> None:
        self.window = window
        self.role = role
        self.rank = rank
        self.topology.world_rank(role, rank)  # validates the rank
        self.sequence = SequenceCounter()
        """Sequence numbers of the messages this rank sends (shared by its endpoints)."""
        self.seen = [0] * (window.num_regions * window.ring_depth)
        """Per local flag index, the value an endpoint last consumed."""
        self.shutdown_announced = False
        """This rank told its peers it sends no more work; no endpoint may send after."""
        self._endpoint: object | None = None

    @property
    def layout(self) -> SlotLayout:
        return self.window.slot

    @property
    def topology(self) -> Topology:
        return self.window.slot.topology

    @property
    def num_peers(self) -> int:
        """Number of opposite-role ranks (the only ranks this one talks to)."""
        return self.topology.num_role_ranks(self.role.opposite)

    # ---- what a backend implements ----------------------------------------------------

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

    def publish_all(self, peers: Sequence[int], flag_index: int, values: Sequence[int]) -> None:
        """:meth:`publish` ``values[i]`` to ``peers[i]``'s flag ``flag_index``, for every
        ``i``; a transport may set them all in one operation (NVSHMEM's
        ``publish="kernel"``: one launch)."""
        if len(peers) != len(values):
            raise InvalidArgument(
                f"publish_all takes one value per peer: {len(values)} values for {len(peers)} peers"
            )
        for peer, value in zip(peers, values, strict=True):
            self.publish(peer, flag_index, value)

    def publish_block(self, peers: Sequence[int], flag_index: int) -> PublishBlock:
        """A :class:`PublishBlock` that sets flag ``flag_index`` of every one of ``peers``
        from values in memory (what a CUDA graph can hold; the graph-replayed exchange uses
        it). This default copies the values with tensor ops on the current stream, which
        is enough where one stream writes every window it publishes to (the loopback
        transport); a backend whose peers are other processes overrides it with a release
        store per flag (NVSHMEM: :mod:`afd_transport_nvshmem.flag_publish`)."""
        for peer in peers:
            self.check_peer(peer)
        targets = [flag_words(self.peer_window(p), self.window)[flag_index] for p in peers]
        return TensorPublishBlock(targets, self.device)

    @abc.abstractmethod
    def wait_any(
        self,
        flag_indices: Sequence[int],
        last_seen: Sequence[int],
        timeout: float,
        peers: Sequence[int],
    ) -> Arrivals:
        """Wait until a local flag word differs from its last-seen value.

        Returns the current values of ``flag_indices`` (at least one differs). Raises
        :class:`~afd_protocol.core.errors.PeerAborted` when one of ``peers`` set its abort
        word or died, :class:`~afd_protocol.core.errors.PeerTimeout` after ``timeout``
        seconds.
        """

    def check_alive(self, peers: Sequence[int]) -> None:  # noqa: B027 - optional
        """Raise :class:`~afd_protocol.core.errors.PeerAborted` when one of ``peers``
        (opposite-role ranks) or this rank's launcher is gone. For a caller that waits on its
        own (a device loop reading page-locked memory) rather than through :meth:`wait_any`,
        which checks this itself; cheap enough to call every few milliseconds. Nothing to
        check by default (in-process transports)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Tell every peer that this rank failed (sets its abort word in their windows)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the window and the peer mappings. Safe to call twice."""

    def check_peer(self, peer: int) -> int:
        """``peer`` if it is an opposite-role rank of this world, else :class:`InvalidArgument`."""
        if not 0 <= peer < self.num_peers:
            raise InvalidArgument(
                f"{self.role.value} rank {self.rank}: peer {peer} is outside "
                f"[0, {self.num_peers}) {self.role.opposite.value} ranks"
            )
        return peer

    # ---- the one endpoint of this window -------------------------------------------------

    def bind(self, endpoint: object) -> None:
        """Record ``endpoint`` as the one endpoint using this window (endpoints call this)."""
        if self._endpoint is not None:
            raise InvalidArgument(
                f"{self.role.value} rank {self.rank} already has an open endpoint "
                f"({type(self._endpoint).__name__}); close it before opening another"
            )
        self._endpoint = endpoint

    def unbind(self, endpoint: object) -> None:
        """Forget ``endpoint`` (its ``close``); another may be opened afterwards."""
        if self._endpoint is endpoint:
            self._endpoint = None

    def __enter__(self) -> WindowTransport:
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
