"""Start-up rendezvous for the host transport through a private directory.

Each rank publishes a small JSON record (its pid and process start time for liveness
checks, its segment's path, and its window geometry) by an atomic rename, then waits for
its peers' records. A rank that fails during start-up publishes a ``failed`` record so
its peers stop waiting at once and report why, instead of timing out.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from afd_protocol.errors import AFDError, PeerAborted, PeerTimeout


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (None if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19])


def process_alive(pid: int, start_time: int) -> bool:
    """True while ``pid`` is the same process and has not exited (zombies count as dead)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X", "x") and int(fields[19]) == start_time


def check_peers_alive(
    who: str, peer_role: str, peers: Sequence[int], pids: Sequence[tuple[int, int]]
) -> None:
    """Raise :class:`PeerAborted` naming every peer in ``peers`` whose process is gone.

    ``pids[p]`` is peer ``p``'s (pid, start time) from the rendezvous; any transport whose
    ranks share this machine can use it to notice a SIGKILLed peer within one check.
    """
    dead = [p for p in peers if not process_alive(*pids[p])]
    if dead:
        raise PeerAborted(
            f"{who}: {peer_role} rank(s) {dead} (pid {[pids[p][0] for p in dead]}) exited"
        )


class DirectoryRendezvous:
    """Key -> JSON record exchange in a directory private to this user."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise AFDError(f"cannot create the rendezvous directory {self.path}: {exc}") from exc
        info = self.path.stat()
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise AFDError(
                f"rendezvous directory {self.path} must belong to this user with mode 0700"
            )

    def publish(self, key: str, record: Mapping[str, Any]) -> None:
        tmp = self.path / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(dict(record)))
        os.replace(tmp, self.path / f"{key}.json")

    def read(self, key: str) -> dict[str, Any] | None:
        try:
            record: dict[str, Any] = json.loads((self.path / f"{key}.json").read_text())
        except FileNotFoundError:
            return None
        return record

    def records(self) -> dict[str, dict[str, Any]]:
        out = {}
        for file in self.path.glob("*.json"):
            record = self.read(file.stem)
            if record is not None:
                out[file.stem] = record
        return out

    def wait_for(
        self, keys: Sequence[str], failed_keys: Sequence[str], timeout: float, what: str
    ) -> dict[str, dict[str, Any]]:
        """Wait until every key is published; fail fast if a ``failed_keys`` record appears."""
        deadline = time.monotonic() + timeout
        found: dict[str, dict[str, Any]] = {}
        delay = 0.001
        while True:
            for key in keys:
                if key not in found:
                    record = self.read(key)
                    if record is not None:
                        found[key] = record
            if len(found) == len(keys):
                return found
            for key in failed_keys:
                failure = self.read(key)
                if failure is not None:
                    raise PeerAborted(
                        f"{failure.get('who', key)} failed during start-up: "
                        f"{failure.get('reason', 'unknown reason')}"
                    )
            if time.monotonic() >= deadline:
                missing = [k for k in keys if k not in found]
                raise PeerTimeout(
                    f"{what}: no {', '.join(missing)} within {timeout:g} s in {self.path}; "
                    f"start every rank with the same rendezvous directory, or raise the "
                    f"connect timeout"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


class DirectoryStore:
    """A key-value store (``set``/blocking ``get`` of bytes) over a rendezvous directory.

    Lets a device transport bootstrap through the same private directory the launcher
    already made, with no TCP port at all.
    """

    def __init__(self, path: str | Path, timeout: float = 60.0) -> None:
        self._rendezvous = DirectoryRendezvous(path)
        self._timeout = timeout

    @staticmethod
    def _key(key: str) -> str:
        return "kv-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in key)

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._rendezvous.publish(self._key(key), {"hex": data.hex()})

    def check(self, keys: list[str]) -> bool:
        """True when every key is set (never blocks)."""
        return all(self._rendezvous.read(self._key(k)) is not None for k in keys)

    def get(self, key: str) -> bytes:
        name = self._key(key)
        found = self._rendezvous.wait_for([name], [], self._timeout, f"store key {key!r}")
        return bytes.fromhex(found[name]["hex"])
