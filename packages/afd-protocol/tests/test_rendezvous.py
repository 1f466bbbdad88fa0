"""The rendezvous every transport starts and stops with, over both stores."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from afd_protocol import (
    AFDError,
    DirectoryStore,
    PeerAborted,
    PeerTimeout,
    Rendezvous,
    Role,
    SlotLayout,
    TcpStore,
    Topology,
    TopologyError,
)

TOPO = Topology(1, 2, 4)


def geometry(tokens: int = 16) -> dict[str, object]:
    return SlotLayout(TOPO, 8, tokens, 2).window().describe()


def rendezvous(store: DirectoryStore, role: Role, rank: int) -> Rendezvous:
    return Rendezvous(store, TOPO, role, rank, liveness_interval=0.01)


def test_directory_store_round_trips_bytes_and_lists_by_prefix(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "rdv", timeout=0.2)
    assert os.stat(tmp_path / "rdv").st_mode & 0o777 == 0o700
    store.set("afd/rank/0", b"\x00\x01 zero")
    store.set("afd/other/1", b"x")
    assert store.get("afd/rank/0") == b"\x00\x01 zero"
    assert store.check(["afd/rank/0", "afd/other/1"])
    assert not store.check(["afd/rank/9"])
    assert store.items("afd/rank/") == {"afd/rank/0": b"\x00\x01 zero"}
    with pytest.raises(PeerTimeout, match=r"'afd/never' did not appear within 0\.2 s"):
        store.get("afd/never")


def test_directory_store_refuses_a_directory_others_can_read(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(AFDError, match="mode 0700"):
        DirectoryStore(shared)


def test_join_exchanges_records_and_names_the_first_differing_parameter(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "rdv")
    results: dict[int, object] = {}

    def join(rank: int, tokens: int) -> None:
        rdv = rendezvous(store, Role.FFN, rank)
        try:
            results[rank] = rdv.join(geometry(tokens), [0], timeout=5, segment=f"s{rank}")
        except Exception as exc:
            results[rank] = exc

    threads = [
        threading.Thread(target=join, args=(0, 16)),
        threading.Thread(target=join, args=(1, 32)),
    ]
    for t in threads:
        t.start()
    attention = rendezvous(store, Role.ATTENTION, 0)
    with pytest.raises(TopologyError, match="max_num_batched_tokens is 16 here but 32 there"):
        attention.join(geometry(16), [1, 2], timeout=5)
    for t in threads:
        t.join(timeout=10)
    ffn0 = results[0]
    assert isinstance(ffn0, dict)
    assert ffn0[0].who == "attention rank 0"
    assert ffn0[0].pid == os.getpid()
    # The mismatch was published, so a rank waiting on the attention rank fails at once.
    assert b"max_num_batched_tokens" in (store.read("afd/failed/0") or b"")
    late = rendezvous(store, Role.FFN, 0)
    with pytest.raises(PeerAborted, match="attention rank 0 failed: window geometry differs"):
        late.barrier("attached", [0], timeout=5)


class _LateCheck(DirectoryStore):
    """A store whose first ``check`` answers "missing": the peer publishes its word and then
    fails between this rank's two reads (the race a loaded machine hits)."""

    checks = 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        return self.checks > 1 and super().check(keys)


def test_a_word_published_before_the_peer_failed_still_ends_the_wait(tmp_path: Path) -> None:
    store = _LateCheck(tmp_path / "rdv")
    attention = rendezvous(store, Role.ATTENTION, 0)
    store.set(attention.key("rank", 0), b"{}")
    attention.fail("window geometry differs")
    ffn = rendezvous(store, Role.FFN, 0)
    ffn._wait("rank", [0], timeout=5, what="ffn rank 0 waiting")  # returns: the word is there
    with pytest.raises(PeerAborted, match="attention rank 0 failed: window geometry differs"):
        ffn.barrier("attached", [0], timeout=5)


def test_a_missing_peer_times_out_naming_it(tmp_path: Path) -> None:
    rdv = rendezvous(DirectoryStore(tmp_path / "rdv"), Role.ATTENTION, 0)
    with pytest.raises(PeerTimeout, match=r"no word from ffn rank 0, ffn rank 1 within 0\.2 s"):
        rdv.join(geometry(), [1, 2], timeout=0.2)


def test_a_dead_peer_ends_a_barrier_and_is_named(tmp_path: Path) -> None:
    """A peer whose process exited is found through /proc, not by waiting out the timeout."""
    store = DirectoryStore(tmp_path / "rdv")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    record = {"who": "ffn rank 0", "pid": child.pid, "start_time": 1, "geometry": geometry()}
    store.set("afd/rank/1", json.dumps(record).encode())
    rdv = rendezvous(store, Role.ATTENTION, 0)
    rdv.join(geometry(), [1], timeout=5)
    with pytest.raises(PeerAborted, match=r"ffn rank 0 \(pid \d+\) exited"):
        rdv.barrier("close", [1], timeout=None)
    with pytest.raises(PeerAborted, match="ffn rank 0"):
        rdv.check_alive([1])


def test_tcp_store_exchanges_bytes_and_times_out_clearly() -> None:
    with socket.socket() as probe:  # a free port on loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stores: dict[int, TcpStore] = {}

    def open_store(rank: int) -> None:
        stores[rank] = TcpStore(rank, 2, timeout=5.0, port=port)

    threads = [threading.Thread(target=open_store, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    uid = bytes(range(128))
    stores[0].set("afd/nvshmem/uid", uid)
    assert stores[1].get("afd/nvshmem/uid") == uid
    assert stores[0].check(["afd/nvshmem/uid"])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        alone_port = probe.getsockname()[1]
    alone = TcpStore(0, 1, timeout=0.3, port=alone_port)
    with pytest.raises(PeerTimeout, match=r"did not appear within 0\.3 s"):
        alone.get("afd/never")
