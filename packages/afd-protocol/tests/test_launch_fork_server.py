"""Ranks are forked from multiprocessing's fork server (torch imported once), yet behave
as spawned ones: each sees the launcher's environment at the launch, and the server with
its socket directory is gone when the launching process exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import afd_shm_workers as workers
import pytest

from afd_protocol import AFDError, InvalidArgument, Role, SlotLayout, Topology
from afd_protocol.launch import GPU_START_METHOD, START_METHOD_ENV, RankSpec, launch

WINDOW = SlotLayout(Topology(1, 1, 4), 8, 8, 2).window()
NAMES = ["AFD_TEST_LATE", "TMPDIR"]


def _specs() -> list[RankSpec]:
    return [RankSpec(role, 0, workers.report_environment, {"names": NAMES}) for role in Role]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_rank_sees_the_environment_of_its_launch_not_of_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    monkeypatch.setenv(START_METHOD_ENV, method)
    launch(WINDOW, _specs(), timeout=120)  # the server (if any) starts with the old values
    monkeypatch.setenv("AFD_TEST_LATE", "set after the first launch")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    results = launch(WINDOW, _specs(), timeout=120)
    for result in results.values():
        assert result.value == {
            "AFD_TEST_LATE": "set after the first launch",
            "TMPDIR": str(tmp_path),
        }


def test_an_unknown_start_method_is_refused_before_any_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(AFDError, match="AFD_START_METHOD must be forkserver or spawn, got 'fork'"):
        launch(WINDOW, _specs(), timeout=120)


def test_a_caller_chooses_the_default_start_method_and_the_environment_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU callers pass ``spawn`` (GPU_START_METHOD): those ranks are the launcher's own
    children; forked ranks are the fork server's; ``AFD_START_METHOD`` wins over either."""
    specs = [RankSpec(role, 0, workers.report_parent, {}) for role in Role]

    def parents(**options: str) -> set[int]:
        return {r.value for r in launch(WINDOW, specs, timeout=120, **options).values()}

    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert GPU_START_METHOD == "spawn"
    assert parents(default_start_method=GPU_START_METHOD) == {os.getpid()}
    forked = parents()
    assert len(forked) == 1  # the fork server, one for both ranks
    assert os.getpid() not in forked
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    assert parents(default_start_method="spawn") == forked
    with pytest.raises(InvalidArgument, match="start method must be forkserver or spawn"):
        parents(default_start_method="fork")


def test_the_fork_server_and_its_directory_are_gone_when_the_process_exits(
    tmp_path: Path,
) -> None:
    program = textwrap.dedent(
        """
        import multiprocessing.forkserver
        import afd_shm_workers as workers
        from afd_protocol import Role, SlotLayout, Topology
        from afd_protocol.launch import RankSpec, launch

        window = SlotLayout(Topology(1, 1, 4), 8, 8, 2).window()
        specs = [RankSpec(r, 0, workers.report_environment, {"names": []}) for r in Role]
        launch(window, specs, timeout=120)
        print(multiprocessing.forkserver._forkserver._forkserver_pid)
        """
    )
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(Path(workers.__file__).parent), *sys.path]),
    }
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    server = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{server}").exists() and _state(server) != "Z":
        assert time.monotonic() < deadline, f"the fork server {server} outlived its process"
        time.sleep(0.1)
    assert list(tmp_path.iterdir()) == []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"
