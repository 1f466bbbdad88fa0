"""Where the emulated operators find the ranks' windows: a world per communicator name.

On the NPU every operator takes ``group_name`` (the HCCL communicator's name) and finds
its own window and its peers' through the communicator. The emulator keeps, per process,
a registry from that name to a :class:`CamWorld`: an object that gives the window of any
world rank this process may touch, the spin timeout (the NPU has none: it would spin
forever), and a description of the protocol state for the timeout's message.

:class:`LocalCamWorld` holds every rank's window in this process, for tests that drive
all ranks step by step from one thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from afd_protocol import InvalidArgument, PeerAborted, PeerTimeout

DEFAULT_SPIN_TIMEOUT = 600.0
"""Seconds an emulated receive spins before raising (the NPU would spin forever)."""


class CamWorld(Protocol):
    """The windows of one emulated CAM communicator, as this process sees them."""

    @property
    def world_size(self) -> int: ...

    @property
    def spin_timeout(self) -> float: ...

    def window(self, world_rank: int) -> torch.Tensor:
        """The flat uint8 window of ``world_rank`` (this process's own or a peer's)."""
        ...

    def check_peers(self) -> None:
        """Raise :class:`~afd_protocol.PeerAborted` if a peer failed or died (called while
        an operator spins, so a dead peer is reported instead of waited for)."""
        ...


class LocalCamWorld:
    """Every rank's window in this process (zero-initialised, as HCCL windows start)."""

    def __init__(
        self, world_size: int, window_bytes: int, spin_timeout: float = DEFAULT_SPIN_TIMEOUT
    ) -> None:
        if world_size < 2:
            raise InvalidArgument(f"a CAM world needs >= 2 ranks, got {world_size}")
        self._windows = [torch.zeros(window_bytes, dtype=torch.uint8) for _ in range(world_size)]
        self._timeout = spin_timeout

    @property
    def world_size(self) -> int:
        return len(self._windows)

    @property
    def spin_timeout(self) -> float:
        return self._timeout

    def window(self, world_rank: int) -> torch.Tensor:
        if not 0 <= world_rank < len(self._windows):
            raise InvalidArgument(f"world rank {world_rank} is outside [0, {len(self._windows)})")
        return self._windows[world_rank]

    def check_peers(self) -> None:
        """Every rank lives in this process: nothing can die apart from it."""


_WORLDS: dict[str, CamWorld] = {}
_LOCK = threading.Lock()


def register_world(group_name: str, world: CamWorld) -> None:
    """Make ``world`` the one the operators use for ``group_name`` in this process."""
    with _LOCK:
        if group_name in _WORLDS:
            raise InvalidArgument(
                f"an emulated CAM communicator named {group_name!r} is already registered in "
                f"this process; unregister it first or pick another name"
            )
        _WORLDS[group_name] = world


def unregister_world(group_name: str) -> None:
    with _LOCK:
        _WORLDS.pop(group_name, None)


def world_for(group_name: str) -> CamWorld:
    try:
        return _WORLDS[group_name]
    except KeyError:
        known = sorted(_WORLDS) or "none"
        raise InvalidArgument(
            f"no emulated CAM communicator named {group_name!r} in this process (registered: "
            f"{known}); create one and register_world() it before calling the operators"
        ) from None


_OVERRIDE = threading.local()
PEER_CHECK_INTERVAL = 0.05


@contextlib.contextmanager
def spin_timeout(seconds: float) -> Iterator[None]:
    """Within the block, this thread's operators spin at most ``seconds`` (an endpoint's
    per-call timeout; the operators themselves take none)."""
    previous = getattr(_OVERRIDE, "seconds", None)
    _OVERRIDE.seconds = seconds
    try:
        yield
    finally:
        _OVERRIDE.seconds = previous


def spin_until(
    ready: Callable[[], bool], world: CamWorld, what: str, state: Callable[[], str]
) -> None:
    """Poll ``ready`` until it holds, checking the peers every 50 ms; raise
    :class:`PeerTimeout` with ``what`` and the protocol ``state`` after the spin timeout
    (where the NPU would spin forever)."""
    override = getattr(_OVERRIDE, "seconds", None)
    timeout = world.spin_timeout if override is None else override
    start = time.monotonic()
    deadline = start + timeout
    next_check = start + PEER_CHECK_INTERVAL
    pause = 1e-5
    while not ready():
        now = time.monotonic()
        if now >= next_check:
            try:
                world.check_peers()
            except PeerAborted:
                # A peer may write what this wait needs and then exit or close between
                # the two reads: it has arrived, and the failure stops the next wait.
                if ready():
                    return
                raise
            next_check = now + PEER_CHECK_INTERVAL
        if now >= deadline:
            raise PeerTimeout(
                f"{what} did not happen within {timeout:g} s (the NPU operator would spin "
                f"forever); state: {state()}"
            )
        time.sleep(pause)
        pause = min(pause * 2, 5e-4)
