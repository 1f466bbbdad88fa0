"""Nothing afd creates is reachable by other users or other machines: shared-memory segments
are 0600, rendezvous directories 0700, and the TCP store listens on loopback only."""

from __future__ import annotations

import multiprocessing.util
import os
import socket
import stat
import tempfile
from pathlib import Path

import afd_shm_workers as workers
import pytest

from afd_protocol import DirectoryStore, Role, SlotLayout, TcpStore, Topology
from afd_protocol.launch import RankSpec, launch
from afd_protocol.shm.segments import SharedSegment


def test_a_shared_memory_segment_is_private_to_this_user() -> None:
    segment = SharedSegment.create(4096, tag="perm")
    try:
        info = segment.path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_uid == os.getuid()
    finally:
        segment.close()
    assert not segment.path.exists()


def test_rendezvous_directories_are_private(tmp_path: Path) -> None:
    DirectoryStore(tmp_path / "rdv")
    assert stat.S_IMODE((tmp_path / "rdv").stat().st_mode) == 0o700


def test_the_launchers_rendezvous_directory_is_private(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR in this process too
    window = SlotLayout(Topology(1, 1, 4), 8, 8, 2).window()
    specs = [RankSpec(role, 0, workers.report_rendezvous_mode) for role in Role]
    results = launch(window, specs, timeout=120)
    assert {r.value for r in results.values()} == {0o700}
    # removed afterwards; what may remain is multiprocessing's directory for the fork
    # server's socket, which lives as long as this process (test_launch_fork_server.py)
    assert set(tmp_path.iterdir()) <= {Path(multiprocessing.util.get_temp_dir())}


def _listening(port: int) -> list[str]:
    """Local addresses listening on ``port`` (hex, as /proc/net/tcp* writes them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


def test_the_tcp_store_listens_on_loopback_only() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = TcpStore(0, 1, timeout=5.0, port=port)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert _listening(port) == ["0100007F"]  # 127.0.0.1, and no IPv4/IPv6 wildcard


def test_a_namespace_keeps_concurrent_runs_segments_apart(monkeypatch) -> None:
    """Two test runs (or deployments) sharing /dev/shm each see only their own segments,
    so one's leak check never counts the other's; a bad name is refused with what to use."""
    from afd_protocol import AFDError
    from afd_protocol.shm import NAMESPACE_ENV, leftover_segments, segment_prefix

    monkeypatch.setenv(NAMESPACE_ENV, "runA")
    a = SharedSegment.create(4096, tag="ns")
    monkeypatch.setenv(NAMESPACE_ENV, "runB")
    b = SharedSegment.create(4096, tag="ns")
    try:
        assert a.path.name.startswith("afd-runA-ns-")
        assert segment_prefix() == "afd-runB-"
        assert leftover_segments() == [b.path]
        monkeypatch.setenv(NAMESPACE_ENV, "runA")
        assert leftover_segments() == [a.path]
        # a peer of either run still maps it: it is an afd segment
        SharedSegment.attach(b.path, 4096).close()
    finally:
        a.close()
        b.close()
    assert leftover_segments() == []
    monkeypatch.setenv(NAMESPACE_ENV, "no/slashes")
    with pytest.raises(AFDError, match=r"AFD_SHM_NAMESPACE='no/slashes'.*letters, digits or"):
        segment_prefix()


def test_each_rank_gets_its_own_environment() -> None:
    """RankSpec.env reaches that rank's process only (how an MPS share is given per rank)."""
    window = SlotLayout(Topology(1, 1, 4), 8, 8, 2).window()
    names = ["AFD_TEST_SHARE", "AFD_TEST_ONLY_FFN"]
    specs = [
        RankSpec(Role.ATTENTION, 0, workers.report_environment, {"names": names},
                 env={"AFD_TEST_SHARE": "60"}),
        RankSpec(Role.FFN, 0, workers.report_environment, {"names": names},
                 env={"AFD_TEST_SHARE": "40", "AFD_TEST_ONLY_FFN": "yes"}),
    ]  # fmt: skip
    results = launch(window, specs, timeout=120)
    assert results["attention rank 0"].value == {"AFD_TEST_SHARE": "60", "AFD_TEST_ONLY_FFN": None}
    assert results["ffn rank 0"].value == {"AFD_TEST_SHARE": "40", "AFD_TEST_ONLY_FFN": "yes"}
    assert "AFD_TEST_SHARE" not in os.environ
