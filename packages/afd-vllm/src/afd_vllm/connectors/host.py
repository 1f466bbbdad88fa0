"""``HostAsyncAFDConnector``: afd's windows in host shared memory (CPU; one machine).

The ranks meet in a rendezvous directory. A deployment that crashed, or ended, leaves its
records there, and a new deployment using the same directory would read them (and fail on
segments that no longer exist); so the first rank to arrive clears a directory whose every
record names a process that is gone (:func:`clear_stale_rendezvous`).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path

from afd_protocol import Connection, DirectoryStore, ShmTransport, process_alive, process_start_time
from afd_protocol.window import WindowConnection
from afd_vllm.connectors.base import AFDConnector
from afd_vllm.extra import HostExtraConfig


class HostAsyncAFDConnector(AFDConnector):
    name = "HostAsyncAFDConnector"

    def rendezvous_dir(self) -> Path:
        """``connector_extra_config.rendezvous_dir``, or one directory per port under the
        temporary directory (both roles compute the same one)."""
        extra = self.config.extra
        assert isinstance(extra, HostExtraConfig)
        if extra.rendezvous_dir:
            return Path(extra.rendezvous_dir)
        return Path(tempfile.gettempdir()) / f"afd-vllm-{self.config.port}"

    def connect(self, rank: int, connect_timeout: float = 60.0) -> Connection:
        folder = self.rendezvous_dir()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        clear_stale_rendezvous(folder)
        return WindowConnection(
            ShmTransport(self.window(), self.role, rank, folder, connect_timeout=connect_timeout)
        )


CLAIM_PREFIX = "afd-vllm/claim/"
"""A record each arriving rank leaves (its pid and start time), so that a rank arriving
just after it sees a live process and clears nothing."""


def clear_stale_rendezvous(folder: Path) -> bool:
    """Remove every record in ``folder`` when all of them name processes that are gone, and
    leave this process's claim; returns whether anything was removed. Serialised by a lock
    file, so two ranks arriving together cannot remove each other's records."""
    store = DirectoryStore(folder)
    with (folder / ".afd-vllm.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = [value for key, value in store.items().items() if "/rank/" in key]
        records += list(store.items(CLAIM_PREFIX).values())
        alive = False
        for raw in records:
            try:
                record = json.loads(raw)
                alive = alive or process_alive(int(record["pid"]), record["start_time"])
            except (ValueError, KeyError, TypeError):
                continue  # not a record this check understands: it does not keep anything
        stale = bool(records) and not alive
        if stale:
            for file in folder.glob("*.kv"):
                file.unlink(missing_ok=True)
        pid = os.getpid()
        claim = {"pid": pid, "start_time": process_start_time(pid)}
        store.set(f"{CLAIM_PREFIX}{pid}", json.dumps(claim).encode())
    return stale
