"""The lockstep of synchronous AFD across the attention replicas of ``afd run``.

Every replica sends one small message to every other replica at each step and waits until
it has heard from all of them: an all-gather of one value (whether the replica has work),
which doubles as the barrier. Messages travel through pipes, so a waiting replica wakes as
soon as the last one arrives (no polling delay), nothing is created that could outlive a
crash (no semaphore, no shared-memory name), and the wait checks, between short slices,
that the other replicas and the launcher are still alive -- a dead replica is reported in a
fraction of a second, like every other wait of afd, instead of holding the others until a
timeout. :class:`LockstepEndpoint` puts that barrier before every MoE dispatch.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from afd_protocol import (
    AttentionEndpoint,
    DispatchHandle,
    PeerAborted,
    PeerTimeout,
    process_alive,
    supervisor_from_env,
)
from afd_tools.run.breakdown import TimedEndpoint
from afd_tools.run.forwarding import DispatchCall, ForwardingEndpoint

_MESSAGE = struct.Struct("<iq")
"""(sender, value)."""
POLL_SLICE = 0.05
"""Seconds between liveness checks while waiting."""


class Lockstep:
    """One replica's end of the lockstep (see the module docstring).

    ``inbox`` is this replica's reading end; ``outboxes[r]`` the writing end of replica
    ``r``'s inbox (this replica's own is unused). Make the pipes with :func:`pipes`.
    ``replicas[r]`` is replica ``r``'s ``(pid, start time)`` for liveness checks (from
    :func:`afd_protocol.launch.roster` in a launched rank).
    """

    def __init__(
        self,
        me: int,
        inbox: Connection,
        outboxes: Sequence[Connection],
        replicas: Mapping[int, tuple[int, int | None]],
    ) -> None:
        self.me = me
        self._inbox = inbox
        self._outboxes = list(outboxes)
        self._others = [r for r in range(len(outboxes)) if r != me]
        self._heard: dict[int, list[int]] = {r: [] for r in self._others}
        """Per replica, the values received and not yet consumed, in step order."""
        self._replicas = dict(replicas)
        self._supervisor = supervisor_from_env()
        self.waited_s = 0.0

    def exchange(self, value: int, timeout: float, what: str) -> list[int]:
        """Send ``value`` to every other replica and return every replica's value of this
        step, by replica; raises :class:`PeerAborted` / :class:`PeerTimeout`."""
        message = _MESSAGE.pack(self.me, value)
        for r in self._others:
            self._outboxes[r].send_bytes(message)
        start = time.monotonic()
        deadline = start + timeout
        while any(not self._heard[r] for r in self._others):
            if self._inbox.poll(POLL_SLICE):
                sender, got = _MESSAGE.unpack(self._inbox.recv_bytes())
                self._heard[sender].append(got)
                continue
            self._check_alive(what)
            if time.monotonic() >= deadline:
                missing = [r for r in self._others if not self._heard[r]]
                raise PeerTimeout(
                    f"attention replica {self.me}: no word from replicas {missing} within "
                    f"{timeout:g} s ({what})"
                )
        self.waited_s += time.monotonic() - start
        return [
            value if r == self.me else self._heard[r].pop(0) for r in range(len(self._outboxes))
        ]

    def barrier(self, timeout: float, what: str) -> None:
        """Wait until every replica reached the same step."""
        self.exchange(0, timeout, what)

    def _check_alive(self, what: str) -> None:
        if self._supervisor is not None and not process_alive(*self._supervisor):
            raise PeerAborted(f"attention replica {self.me}: the launcher exited ({what})")
        waiting_for = [r for r in self._others if not self._heard[r]]
        dead = [
            r for r in waiting_for if r in self._replicas and not process_alive(*self._replicas[r])
        ]
        if dead:
            raise PeerAborted(f"attention replica {self.me}: replicas {dead} exited ({what})")


class LockstepEndpoint(ForwardingEndpoint):
    """An attention endpoint whose every dispatch first waits for all replicas: the
    lockstep of synchronous AFD, as an :class:`~afd_protocol.AttentionEndpoint`.
    :attr:`wait_s` adds up the host's seconds in those waits (reset it per step). Over a
    :class:`~afd_tools.run.breakdown.TimedEndpoint` each wait is also marked on its clock,
    so the step's breakdown counts the barrier on the device's timeline: on a GPU the host
    may reach the barrier while its own compute still runs, and only the time the device
    then sits idle is the barrier's."""

    def __init__(self, endpoint: AttentionEndpoint, lockstep: Lockstep, timeout: float) -> None:
        super().__init__(endpoint)
        self.lockstep = lockstep
        self.timeout = timeout
        self.wait_s = 0.0
        self._timed = endpoint if isinstance(endpoint, TimedEndpoint) else None

    def forward_dispatch(self, call: DispatchCall) -> DispatchHandle:
        """Wait for every replica, then dispatch."""
        timed = self._timed
        marked = timed.clock.mark() if timed is not None else None
        start = time.monotonic()
        self.lockstep.barrier(self.timeout, f"lockstep before layer {call.layer_idx}")
        self.wait_s += time.monotonic() - start
        if timed is not None:
            timed.add_barrier(marked, timed.clock.mark())
        return super().forward_dispatch(call)


def pipes(ctx: Any, replicas: int) -> tuple[list[Connection], list[Connection]]:
    """``(inboxes, outboxes)``: one one-way pipe per replica."""
    ends = [ctx.Pipe(duplex=False) for _ in range(replicas)]
    return [reader for reader, _ in ends], [writer for _, writer in ends]
