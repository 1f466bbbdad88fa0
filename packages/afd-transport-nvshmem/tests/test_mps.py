"""The MPS helper on the CPU, against a stand-in ``nvidia-cuda-mps-control``
(:mod:`afd_transport_nvshmem.mps_stand_in`, which the ``afd`` tools' tests use too).

The stand-in behaves as the real control program does where afd relies on it: ``-d``
daemonises (a process named ``nvidia-cuda-mps``..., environment kept) that opens
``$CUDA_MPS_PIPE_DIRECTORY/control``; the program without ``-d`` reads commands on stdin
(``get_server_list`` succeeds only while a daemon listens, ``quit`` stops it). Switches in
the environment make it misbehave: fail to start, never open its pipe, ignore ``quit``.
What is checked is afd's side: private directories, reuse of a running daemon, bounded
waits, and that nothing -- process or directory -- is left after ``close``, also on
failure.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from afd_protocol import TopologyError
from afd_transport_nvshmem import mps
from afd_transport_nvshmem.mps import MpsDaemon, MpsError, client_share, equal_shares
from afd_transport_nvshmem.mps_stand_in import wait_gone as _wait_gone
from afd_transport_nvshmem.mps_stand_in import write_stand_in


@pytest.fixture
def control(tmp_path: Path) -> str:
    """The stand-in, named as the real one (so its processes are named alike)."""
    return write_stand_in(tmp_path / "bin")


def test_a_private_daemon_is_started_used_and_stopped_leaving_nothing(control: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    daemon = MpsDaemon.start(control=control, environ=env, timeout=10)
    try:
        assert daemon.owned
        for directory in (daemon.pipe_directory, daemon.log_directory):
            assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert (Path(daemon.pipe_directory) / "control").exists()
        assert len(mps._processes_with(daemon.pipe_directory)) == 1
        client = daemon.client_environment(33)
        assert client == {
            "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_directory,
            "CUDA_MPS_LOG_DIRECTORY": daemon.log_directory,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "33",
        }
        assert client_share(client) == 33  # a rank with this environment is a client
        assert client_share({**client, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": ""}) == 100
    finally:
        daemon.close()
    assert mps._processes_with(daemon.pipe_directory) == []
    assert daemon.scratch is not None
    assert not Path(daemon.scratch).exists()
    assert client_share(client) is None  # nobody answers there any more
    daemon.close()  # idempotent


def test_a_running_daemon_is_used_and_left_running(control: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    first = MpsDaemon.start(control=control, environ=env, timeout=10)
    try:
        env_with = {**env, **first.client_environment(None)}
        second = MpsDaemon.start(control=control, environ=env_with, timeout=10)
        assert not second.owned
        assert second.pipe_directory == first.pipe_directory
        second.close()
        assert len(mps._processes_with(first.pipe_directory)) == 1  # still there
    finally:
        first.close()
    assert _wait_gone(first.pipe_directory)


@pytest.mark.parametrize(
    ("switch", "says"),
    [
        ("FAKE_MPS_FAIL", "exited with 1: An instance of this daemon is already running"),
        ("FAKE_MPS_SILENT", "did not open"),
    ],
)
def test_a_daemon_that_does_not_come_up_is_an_error_and_leaves_nothing(
    control: str, switch: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    made: list[str] = []
    real_mkdtemp = mps.tempfile.mkdtemp

    def recording_mkdtemp(**kwargs: str) -> str:
        made.append(real_mkdtemp(**kwargs))
        return made[-1]

    monkeypatch.setattr(mps.tempfile, "mkdtemp", recording_mkdtemp)
    started = time.monotonic()
    with pytest.raises(MpsError, match=says):
        MpsDaemon.start(control=control, environ={**env, switch: "1"}, timeout=1.0)
    assert time.monotonic() - started < 10  # bounded
    assert len(made) == 1
    assert not Path(made[0]).exists()
    assert _wait_gone(str(Path(made[0]) / "pipe"))  # a silent daemon was killed


def test_a_daemon_that_ignores_quit_is_killed_within_the_bound(control: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    daemon = MpsDaemon.start(control=control, environ={**env, "FAKE_MPS_STUBBORN": "1"})
    started = time.monotonic()
    daemon.close(timeout=0.5)
    assert time.monotonic() - started < 5
    assert _wait_gone(daemon.pipe_directory, timeout=5)


def test_missing_control_program_and_bad_shares_say_what_to_do(tmp_path: Path) -> None:
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = str(tmp_path)
    try:
        with pytest.raises(MpsError, match="nvidia-cuda-mps-control was not found on PATH"):
            mps.find_control(search=(str(tmp_path),))
    finally:
        os.environ["PATH"] = old_path
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    for bad in ("0", "101", "half"):
        with pytest.raises(MpsError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
            client_share({**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": bad})
    assert client_share({**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}) == 50
    assert client_share({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")}) is None
    daemon = MpsDaemon(str(pipe), "", owned=False, control="x")
    with pytest.raises(MpsError, match="1 to 100 percent"):
        daemon.client_environment(0)
    # the verified shares only (33 % gave NaN on the H200): three ranks get 25 % each
    assert [equal_shares(n) for n in (1, 2, 3, 4, 5, 8)] == [100, 50, 25, 25, 20, 12]
    with pytest.raises(ValueError, match="ranks_per_gpu"):
        equal_shares(0)


def test_sharing_rules_name_ranks_and_numbers() -> None:
    names = {0: "attention rank 0", 1: "attention rank 1", 2: "ffn rank 0"}.__getitem__
    gpus = {0: "g", 1: "g", 2: "g"}
    mps.check_gpu_sharing(gpus, {0: 33, 1: 33, 2: 33}, names)
    with pytest.raises(TopologyError, match=r"adding up to 150 %"):
        mps.check_gpu_sharing(gpus, {0: 50, 1: 50, 2: 50}, names)
    with pytest.raises(
        TopologyError, match="but attention rank 1 and ffn rank 0 are not CUDA MPS clients: "
    ):
        mps.check_gpu_sharing(gpus, {0: 33, 1: None, 2: None}, names)
