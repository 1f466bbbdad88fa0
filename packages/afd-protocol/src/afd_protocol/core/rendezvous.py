"""Start-up and shutdown agreement between the ranks of one AFD world, over a key-value store.

Every transport needs the same few agreements before and after it moves a byte: each rank
publishes who it is (pid and process start time, for liveness) and its window geometry,
checks that every peer derived the same geometry (naming the first parameter that
differs), waits at barriers ("every peer mapped my window", "every rank passed its
checks", "every rank reached close"), and fails fast -- never by timing out -- when a peer
reported a failure or its process is gone. :class:`Rendezvous` does all of this once,
over any :class:`KeyValueStore`:

* :class:`DirectoryStore` -- files in a private directory (no port; what the process
  launcher and the shared-memory transport use);
* :class:`TcpStore` -- a ``torch.distributed.TCPStore`` on 127.0.0.1 (what ranks started
  independently use);
* any object with ``set``/``get``/``check`` (an engine's own store).

Liveness is judged from ``/proc`` (pid plus start time, so a reused pid is not mistaken
for the peer): every transport built on this rendezvous runs its ranks on one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from afd_protocol.core.errors import AFDError, PeerAborted, PeerTimeout
from afd_protocol.core.layout import check_same_geometry
from afd_protocol.core.topology import Role, Topology


class KeyValueStore(Protocol):
    """What a rendezvous needs from a store.

    ``get`` blocks until the key exists (up to the store's own timeout, then raises
    :class:`PeerTimeout`); ``check`` tells without blocking whether every key exists.
    """

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


# ---- liveness -----------------------------------------------------------------------


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (None if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19])


def process_alive(pid: int, start_time: int | None) -> bool:
    """True while ``pid`` is the same process and has not exited (zombies count as dead)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X", "x") and int(fields[19]) == start_time


SUPERVISOR_ENV = "AFD_SUPERVISOR"
"""``"pid:start_time"`` of the process that launched this rank (set by the launcher). A
rank whose launcher is gone stops waiting: an orphan would otherwise wait for peers that
nobody will restart, until its timeout."""


def supervisor_from_env() -> tuple[int, int | None] | None:
    """The launcher named in ``AFD_SUPERVISOR``, or None when this rank has none."""
    raw = os.environ.get(SUPERVISOR_ENV)
    if not raw:
        return None
    pid, _, start = raw.partition(":")
    return int(pid), int(start) if start and start != "None" else None


def check_supervisor(who: str) -> None:
    """Raise :class:`PeerAborted` when the launcher named in ``AFD_SUPERVISOR`` is gone: for
    wait loops outside a transport (a rank idle between requests) to stop as orphans."""
    supervisor = supervisor_from_env()
    if supervisor is not None and not process_alive(*supervisor):
        raise PeerAborted(f"{who}: its launcher (pid {supervisor[0]}) exited")


# ---- stores -------------------------------------------------------------------------


class DirectoryStore:
    """A key-value store in a directory private to this user (mode 0700).

    Each key is one file, written by an atomic rename, so a reader sees a whole value or
    nothing. ``get`` polls with exponential back-off up to ``timeout`` seconds.
    """

    def __init__(self, path: str | Path, timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise AFDError(f"cannot create the rendezvous directory {self.path}: {exc}") from exc
        info = self.path.stat()
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise AFDError(
                f"rendezvous directory {self.path} must belong to this user with mode 0700"
            )

    def _file(self, key: str) -> Path:
        return self.path / (urllib.parse.quote(key, safe="") + ".kv")

    def set(self, key: str, value: bytes) -> None:
        target = self._file(key)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(bytes(value))
        os.replace(tmp, target)

    def read(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it is not set (never blocks)."""
        try:
            return self._file(key).read_bytes()
        except FileNotFoundError:
            return None

    def check(self, keys: list[str]) -> bool:
        return all(self._file(k).exists() for k in keys)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            value = self.read(key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise PeerTimeout(
                    f"store key {key!r} did not appear within {self.timeout:g} s in {self.path}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def items(self, prefix: str = "") -> dict[str, bytes]:
        """Every key starting with ``prefix`` and its value (for teardown and diagnostics)."""
        out = {}
        for file in self.path.glob("*.kv"):
            key = urllib.parse.unquote(file.name[: -len(".kv")])
            if key.startswith(prefix):
                value = self.read(key)
                if value is not None:
                    out[key] = value
        return out


DEFAULT_TCP_PORT = 29517
ENV_TCP_PORT = "AFD_STORE_PORT"
OLD_ENV_TCP_PORT = "AFD_NVSHMEM_STORE_PORT"
"""Its name before the rendezvous moved into afd-protocol; still read."""


class TcpStore:
    """A ``torch.distributed.TCPStore`` on 127.0.0.1, hosted by world rank 0.

    The port is ``port``, else ``AFD_STORE_PORT`` (or its old name
    ``AFD_NVSHMEM_STORE_PORT``), else 29517 -- the same on every rank. The host listens on
    the loopback interface only (a socket bound to 127.0.0.1 handed to the store: by itself
    a TCPStore listens on every interface). Timeouts become :class:`PeerTimeout` naming the
    key and the port.
    """

    def __init__(
        self, world_rank: int, world_size: int, timeout: float = 60.0, port: int | None = None
    ) -> None:
        import socket
        from datetime import timedelta

        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, re-exported

        if port is None:
            named = os.environ.get(ENV_TCP_PORT) or os.environ.get(OLD_ENV_TCP_PORT)
            port = int(named) if named else DEFAULT_TCP_PORT
        self.port = port
        self.timeout = timeout
        self._listener: socket.socket | None = None
        hint = f"set {ENV_TCP_PORT} to a free port, the same on every rank"
        if world_rank == 0:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("127.0.0.1", port))
                listener.listen(max(128, world_size))
            except OSError as exc:
                listener.close()
                raise PeerTimeout(
                    f"cannot host the store on 127.0.0.1:{port} ({exc.strerror}); {hint}"
                ) from None
            self._listener = listener
        try:
            self._store = TCPStore(
                "127.0.0.1",
                port,
                world_size,
                is_master=world_rank == 0,
                timeout=timedelta(seconds=timeout),
                master_listen_fd=None if self._listener is None else self._listener.fileno(),
            )
        except RuntimeError as exc:
            raise PeerTimeout(
                f"cannot reach the store on 127.0.0.1:{port} ({exc}); {hint}"
            ) from exc

    def set(self, key: str, value: bytes) -> None:
        # TCPStore takes bytes at run time (its stub says str); a str would be UTF-8 encoded.
        self._store.set(key, value)  # type: ignore[arg-type]

    def check(self, keys: list[str]) -> bool:
        return bool(self._store.check(keys))

    def get(self, key: str) -> bytes:
        try:
            return bytes(self._store.get(key))
        except RuntimeError as exc:
            raise PeerTimeout(
                f"store key {key!r} did not appear within {self.timeout:g} s on "
                f"127.0.0.1:{self.port}"
            ) from exc


# ---- the rendezvous -----------------------------------------------------------------


@dataclass(frozen=True)
class PeerRecord:
    """What one rank published when it joined."""

    world_rank: int
    who: str
    pid: int
    start_time: int | None
    extra: Mapping[str, Any]
    """Whatever the transport added (a segment path, a GPU id, ...)."""


class Rendezvous:
    """One rank's side of the agreements with its peers (see the module docstring).

    Keys live under ``namespace``: ``{ns}/rank/{w}`` (the joined record),
    ``{ns}/failed/{w}`` (why rank ``w`` failed) and ``{ns}/{barrier}/{w}``.
    """

    def __init__(
        self,
        store: KeyValueStore,
        topology: Topology,
        role: Role,
        rank: int,
        *,
        namespace: str = "afd",
        liveness_interval: float = 0.05,
    ) -> None:
        self.store = store
        self.topology = topology
        self.world_rank = topology.world_rank(role, rank)
        self.who = f"{role.value} rank {rank}"
        self._ns = namespace
        self._liveness_interval = liveness_interval
        self._peers: dict[int, PeerRecord] = {}
        self._supervisor = supervisor_from_env()

    def key(self, kind: str, world_rank: int) -> str:
        return f"{self._ns}/{kind}/{world_rank}"

    def describe(self, world_rank: int) -> str:
        return self.topology.rank_name(world_rank)

    def join(
        self,
        geometry: Mapping[str, object],
        peers: Sequence[int],
        timeout: float,
        **extra: Any,
    ) -> dict[int, PeerRecord]:
        """Publish this rank's record, then wait for every peer's and compare geometries.

        ``peers`` are world ranks. Raises :class:`~afd_protocol.core.errors.TopologyError`
        naming the first differing parameter, :class:`PeerAborted` when a peer failed
        first, :class:`PeerTimeout` naming who is missing. On any failure this rank's own
        failure is published, so its peers stop waiting at once.
        """
        record = {
            "who": self.who,
            "pid": os.getpid(),
            "start_time": process_start_time(os.getpid()),
            "geometry": dict(geometry),
            **extra,
        }
        self.store.set(self.key("rank", self.world_rank), json.dumps(record).encode())
        try:
            self._wait("rank", peers, timeout, f"{self.who} waiting for its peers to start")
            for w in peers:
                raw = json.loads(self.store.get(self.key("rank", w)))
                check_same_geometry(geometry, raw["geometry"], peer=self.describe(w))
                known = {"who", "pid", "start_time", "geometry"}
                self._peers[w] = PeerRecord(
                    world_rank=w,
                    who=raw["who"],
                    pid=int(raw["pid"]),
                    start_time=raw["start_time"],
                    extra={k: v for k, v in raw.items() if k not in known},
                )
        except BaseException as exc:
            self.fail(str(exc) or type(exc).__name__)
            raise
        return {w: self._peers[w] for w in peers}

    def barrier(self, name: str, peers: Sequence[int], timeout: float | None) -> None:
        """Arrive at barrier ``name`` and wait until every rank in ``peers`` arrived.

        Raises :class:`PeerAborted` as soon as a peer reported a failure or its process is
        gone, :class:`PeerTimeout` after ``timeout`` seconds (None: no deadline -- the wait
        still ends when a peer dies); either way this rank's failure is published, so the
        others stop waiting for it.
        """
        what = f"{self.who} at the {name!r} barrier"
        self.store.set(self.key(name, self.world_rank), b"1")
        try:
            self._wait(name, peers, timeout, what)
            # A peer may have arrived and reported a failure right after: look once more, so
            # ranks about to enter a collective step (NVSHMEM's start-up) do not wait there
            # for one that will never come. Not liveness: a peer with nothing to do may
            # legitimately have finished and exited already.
            why = self._failure(peers, liveness=False)
            if why is not None:
                raise PeerAborted(f"{what}: {why}")
        except (PeerAborted, PeerTimeout) as exc:
            self.fail(str(exc))
            raise

    def fail(self, reason: str) -> None:
        """Tell every peer that this rank failed (best effort: the store may be gone)."""
        # Failing is already under way: a store that is gone must not hide the first error.
        with contextlib.suppress(Exception):
            self.store.set(self.key("failed", self.world_rank), reason.encode())

    def check_alive(self, peers: Sequence[int]) -> None:
        """Raise :class:`PeerAborted` naming every joined peer whose process is gone, or the
        launcher that started this rank (``AFD_SUPERVISOR``) when it is gone."""
        orphaned = self._orphaned()
        if orphaned is not None:
            raise PeerAborted(f"{self.who}: {orphaned}")
        dead = [w for w in peers if w in self._peers and not self._alive(w)]
        if dead:
            names = ", ".join(f"{self.describe(w)} (pid {self._peers[w].pid})" for w in dead)
            raise PeerAborted(f"{self.who}: {names} exited")

    def _alive(self, world_rank: int) -> bool:
        peer = self._peers[world_rank]
        return process_alive(peer.pid, peer.start_time)

    def _orphaned(self) -> str | None:
        if self._supervisor is not None and not process_alive(*self._supervisor):
            return f"its launcher (pid {self._supervisor[0]}) exited"
        return None

    def _failure(self, peers: Sequence[int], liveness: bool = True) -> str | None:
        """Why some peer failed or died (or the launcher did), or None when all are fine."""
        orphaned = self._orphaned()
        if orphaned is not None:
            return orphaned
        for w in peers:
            failed = self.key("failed", w)
            if self.store.check([failed]):
                reason = self.store.get(failed).decode(errors="replace")
                return f"{self.describe(w)} failed: {reason}"
            if liveness and w in self._peers and not self._alive(w):
                return f"{self.describe(w)} (pid {self._peers[w].pid}) exited"
        return None

    def _wait(self, kind: str, peers: Sequence[int], timeout: float | None, what: str) -> None:
        keys = [self.key(kind, w) for w in peers]
        start = time.monotonic()
        next_check = start
        delay = 0.001
        while not self.store.check(keys):
            now = time.monotonic()
            if now >= next_check:
                why = self._failure(peers)
                # A peer may publish its word and then fail between the two reads: what
                # this wait needs has arrived, and the failure stops the next wait instead.
                if why is not None and not self.store.check(keys):
                    raise PeerAborted(f"{what}: {why}")
                next_check = now + self._liveness_interval
            if timeout is not None and now - start >= timeout:
                missing = [
                    self.describe(w)
                    for w, k in zip(peers, keys, strict=True)
                    if not self.store.check([k])
                ]
                raise PeerTimeout(
                    f"{what}: no word from {', '.join(missing)} within {timeout:g} s; start every "
                    f"rank with the same rendezvous store, or raise the connect timeout"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


__all__ = [
    "SUPERVISOR_ENV",
    "DirectoryStore",
    "KeyValueStore",
    "PeerRecord",
    "Rendezvous",
    "TcpStore",
    "check_supervisor",
    "process_alive",
    "process_start_time",
    "supervisor_from_env",
]
