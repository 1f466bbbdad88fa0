"""Emulated CAM windows shared between processes, one POSIX shared-memory segment per rank.

Each rank creates its window (private, randomly named, see
:mod:`afd_protocol.shm.segments`), meets the others through afd's rendezvous (which
compares every rank's CAM geometry, the way mismatched HCCL tiling would corrupt), maps the
opposite role's windows -- attention ranks write into FFN windows and read their own; FFN
ranks write into attention windows -- and unlinks its name once every peer mapped it, so
nothing is left behind whatever happens next. Memory ordering is the shared-memory
transport's: on x86-64 a ready word stored after its payload is seen after it.

After the window, each segment holds one state word per world rank: a rank that fails
sets its word to :data:`ABORTED` in every peer's segment, one that closes its connection
cleanly sets it to :data:`LEFT`. Every spinning operator checks them, and that the peers'
processes are alive, every 50 ms (the NPU has neither and would hang): an aborted peer,
or a peer whose process is gone without having closed, fails the wait by name; a peer that
left is not waited on for liveness (an attention rank that announced its shutdown exits
while other replicas still work), and once every peer has left nothing more can arrive,
so that fails the wait too. On an attention rank any FFN rank that left fails the wait: it
waits only for replies, and an FFN rank that closed sends none.
"""

from __future__ import annotations

from pathlib import Path

import torch

from afd_protocol import (
    DirectoryStore,
    InvalidArgument,
    KeyValueStore,
    PeerAborted,
    Rendezvous,
    Role,
    SharedSegment,
    Topology,
    check_shared_memory_platform,
    share_segments,
)
from afd_transport_cam.emulator.world import DEFAULT_SPIN_TIMEOUT
from afd_transport_cam.geometry import ALIGN, CamGeometry

RUNNING, ABORTED, LEFT = 0, 1, 2
"""The values of a rank's state word in its peers' segments (module docstring)."""


def describe(geo: CamGeometry) -> dict[str, object]:
    """What every rank of one communicator must agree on (compared at start-up)."""
    return {
        "cam_attn_rank_num": geo.num_attention,
        "cam_moe_rank_num": geo.num_ffn,
        "cam_route_expert_num_per_moe": geo.experts_per_rank,
        "cam_top_k": geo.top_k,
        "cam_hidden_size": geo.hidden_size,
        "cam_max_seq_len": geo.max_seq_len,
        "cam_tp_size": geo.tp_size,
        "cam_dynamic_quant": geo.dynamic_quant,
        "cam_dtype": str(geo.dtype),
        "cam_window_bytes": geo.window_bytes,
    }


class ShmCamWorld:
    """This process's view of an emulated CAM communicator across processes."""

    def __init__(
        self,
        geo: CamGeometry,
        role: Role | str,
        rank: int,
        rendezvous: str | Path | KeyValueStore,
        *,
        connect_timeout: float = 60.0,
        spin_timeout: float = DEFAULT_SPIN_TIMEOUT,
    ) -> None:
        check_shared_memory_platform()
        self._geo = geo
        self._role = Role(role)
        self._timeout = spin_timeout
        self._closed = False
        self._aborted = False
        topology = Topology(
            geo.num_attention, geo.num_ffn, geo.num_experts, attn_ranks_per_dp=geo.tp_size
        )
        self.world_rank = topology.world_rank(self._role, rank)
        self._name = f"{self._role.value} rank {rank}"
        opposite = self._role.opposite
        self._peer_ranks = [
            topology.world_rank(opposite, r) for r in range(topology.num_role_ranks(opposite))
        ]
        store = (
            DirectoryStore(rendezvous, timeout=connect_timeout)
            if isinstance(rendezvous, str | Path)
            else rendezvous
        )
        self._rendezvous = Rendezvous(store, topology, self._role, rank)
        self._state_offset = -(-geo.window_bytes // ALIGN) * ALIGN
        size = self._state_offset + 4 * geo.world_size
        self._segment, self._peers = share_segments(
            self._rendezvous, size, describe(geo), self._peer_ranks, connect_timeout
        )

    @property
    def world_size(self) -> int:
        return self._geo.world_size

    @property
    def spin_timeout(self) -> float:
        return self._timeout

    def _tensor(self, segment: SharedSegment | None) -> torch.Tensor:
        if self._closed or segment is None or segment.tensor is None:
            raise InvalidArgument(f"{self._name}: the emulated CAM windows are closed")
        return segment.tensor

    def window(self, world_rank: int) -> torch.Tensor:
        if world_rank == self.world_rank:
            segment = self._segment
        elif world_rank in self._peers:
            segment = self._peers[world_rank]
        else:
            raise InvalidArgument(
                f"{self._name} maps its own window and the other role's, not world rank "
                f"{world_rank}'s"
            )
        return self._tensor(segment)[: self._geo.window_bytes]

    def _states(self, segment: SharedSegment | None) -> torch.Tensor:
        start = self._state_offset
        return self._tensor(segment)[start : start + 4 * self.world_size].view(torch.int32)

    def check_peers(self) -> None:
        """Raise :class:`PeerAborted` when a peer aborted, died without closing, or every
        peer has closed; on an attention rank, also when any FFN rank has closed (module
        docstring)."""
        running = self._running_peers()
        try:
            self._rendezvous.check_alive(running)
        except PeerAborted:
            # A peer may have closed and exited between reading its word and checking its
            # process: its word is written before it exits, so a second read is final.
            self._rendezvous.check_alive(self._running_peers())

    def _running_peers(self) -> list[int]:
        """The peers that neither aborted nor left (raising where that is a failure)."""
        words = [int(w) for w in self._states(self._segment)]
        failed = [self._rendezvous.describe(p) for p in self._peer_ranks if words[p] == ABORTED]
        if failed:
            raise PeerAborted(
                f"{self._name}: {', '.join(failed)} aborted (see their own error for the cause)"
            )
        left = [p for p in self._peer_ranks if words[p] == LEFT]
        if left and self._role is Role.ATTENTION:
            # Attention ranks wait only for replies, which every FFN rank sends while any
            # attention rank is open: an FFN rank that closed will never answer.
            names = ", ".join(self._rendezvous.describe(p) for p in left)
            raise PeerAborted(
                f"{self._name}: {names} closed its connection while this rank waits for its reply"
            )
        running = [p for p in self._peer_ranks if words[p] != LEFT]
        if not running:
            raise PeerAborted(
                f"{self._name}: every {self._role.opposite.value} rank closed its connection, "
                f"so what this rank waits for cannot arrive"
            )
        return running

    def _tell_peers(self, state: int) -> None:
        for segment in self._peers.values():
            if segment.tensor is not None:
                self._states(segment)[self.world_rank] = state

    def abort(self) -> None:
        """Set this rank's word to ABORTED in every peer's segment (best effort,
        idempotent)."""
        if self._closed or self._aborted:
            return
        self._aborted = True
        self._tell_peers(ABORTED)

    def close(self) -> None:
        """Unmap every window; a rank that did not abort tells its peers it LEFT first."""
        if self._closed:
            return
        if not self._aborted:
            self._tell_peers(LEFT)
        self._closed = True
        if self._segment is not None:
            self._segment.close()
        for segment in self._peers.values():
            segment.close()
