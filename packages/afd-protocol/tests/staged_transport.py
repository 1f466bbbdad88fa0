"""A loopback transport that behaves like a put path: every sender composes its slots in a
staging copy of the peer's window, and :meth:`publish` copies only the slot's
:func:`~afd_protocol.core.extents.used_extents` into the real window before setting the
flag. The real windows' slots start filled with ``0xFF`` bytes (NaN in every float type,
-1 in int32), so a byte the receiver reads but the extents did not carry shows up as NaN
or a refused header -- the test of the extent rules that the NVSHMEM put kernel
implements on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from afd_protocol import Role, used_extents
from afd_protocol.core.layout import WindowLayout
from afd_protocol.window import LoopbackTransport, LoopbackWorld, PublishBlock, abort_words
from afd_protocol.window.views import flag_words


class StagedLoopbackWorld(LoopbackWorld):
    """A :class:`LoopbackWorld` whose transports put used extents (module docstring)."""

    def __init__(self, window: WindowLayout) -> None:
        super().__init__(window)
        for buffer in self.windows.values():
            buffer[window.slots_offset :] = 0xFF
        self.bytes_put = 0
        """Payload bytes every publish so far copied, header included."""
        self.whole_fields = 0
        """What the same publishes would have copied sending every non-empty field whole."""

    def transport(self, role: Role | str, rank: int) -> LoopbackTransport:
        return StagedLoopbackTransport(self, Role(role), rank)


class StagedLoopbackTransport(LoopbackTransport):
    def __init__(self, world: StagedLoopbackWorld, role: Role, rank: int) -> None:
        super().__init__(world, role, rank)
        self._staged_world = world
        self._staging = [
            torch.full((self.window.total_bytes,), 0xFF, dtype=torch.uint8)
            for _ in range(self.num_peers)
        ]

    def peer_window(self, peer: int) -> torch.Tensor:
        return self._staging[self.check_peer(peer)]

    def _real_window(self, peer: int) -> torch.Tensor:
        return self._staged_world.windows[(self.role.opposite, self.check_peer(peer))]

    def publish(self, peer: int, flag_index: int, value: int) -> None:
        region, ring = divmod(flag_index, self.window.ring_depth)
        assert region == self.rank, "a sender publishes only its own region"
        base = self.window.slot_offset(region, ring)
        staging, real = self._staging[peer], self._real_window(peer)
        header = staging[base : base + 4 * self.layout.header_words].view(torch.int32).tolist()
        for extent in used_extents(self.layout, header):
            start = base + extent.offset
            real[start : start + extent.nbytes] = staging[start : start + extent.nbytes]
            self._staged_world.bytes_put += extent.nbytes
        self._staged_world.whole_fields += sum(spec.nbytes for spec in self.layout.fields)
        flag_words(real, self.window)[flag_index] = value

    def publish_block(self, peers: Sequence[int], flag_index: int) -> PublishBlock:
        return _StagedPublishBlock(self, list(peers), flag_index)

    def abort(self) -> None:
        for peer in range(self.num_peers):
            abort_words(self._real_window(peer), self.window)[self.rank] = 1


class _StagedPublishBlock(PublishBlock):
    def __init__(self, transport: StagedLoopbackTransport, peers: list[int], flag_index: int):
        self._transport, self._peers, self._flag_index = transport, peers, flag_index
        self._values = [0] * len(peers)

    @property
    def size(self) -> int:
        return len(self._peers)

    def write(self, values: Sequence[int]) -> None:
        self._check(values)
        self._values = list(values)

    def launch(self) -> None:
        for peer, value in zip(self._peers, self._values, strict=True):
            self._transport.publish(peer, self._flag_index, value)
