"""A stand-in ``nvidia-cuda-mps-control`` for tests on machines without the NVIDIA driver.

It behaves as the real control program does where afd relies on it: ``-d`` daemonises (a
process named ``nvidia-cuda-mps``..., environment kept, in a session of its own) that
opens ``$CUDA_MPS_PIPE_DIRECTORY/control``; the program without ``-d`` reads commands on
stdin (``get_server_list`` succeeds only while a daemon listens, ``quit`` stops it).
Switches in the environment make it misbehave: ``FAKE_MPS_FAIL`` (``-d`` fails),
``FAKE_MPS_SILENT`` (the daemon never opens its pipe), ``FAKE_MPS_STUBBORN`` (it ignores
``quit``). Used by this package's tests and by the ``afd`` tools' tests, so that both check
:class:`~afd_transport_nvshmem.mps.MpsDaemon` against one program.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

from afd_transport_nvshmem.mps import CONTROL, _processes_with

STAND_IN = textwrap.dedent(
    """\
    #!{python}
    import os, sys, time
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    control = os.path.join(pipe, "control")
    if sys.argv[1:] == ["-d"]:
        if os.environ.get("FAKE_MPS_FAIL"):
            print("An instance of this daemon is already running", file=sys.stderr)
            sys.exit(1)
        if os.fork() == 0:
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            if os.environ.get("FAKE_MPS_SILENT"):
                time.sleep(3600)
            open(control, "w").close()
            stubborn = bool(os.environ.get("FAKE_MPS_STUBBORN"))
            while stubborn or not os.path.exists(os.path.join(pipe, "quit")):
                time.sleep(0.02)
            os.unlink(control)
            os._exit(0)
        sys.exit(0)
    for line in sys.stdin:
        if line.strip() == "get_server_list":
            sys.exit(0 if os.path.exists(control) else 1)
        if line.strip() == "quit":
            open(os.path.join(pipe, "quit"), "w").close()
    """
)
"""The stand-in's source (``{python}``: the interpreter that runs it)."""


def write_stand_in(directory: Path) -> str:
    """Write the stand-in into ``directory`` (created) under the real program's name, so its
    processes are named alike; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CONTROL
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def environment_without_mps(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without any ``CUDA_MPS_*`` variable, so that no
    daemon of the machine's is found and reused."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not k.startswith("CUDA_MPS_")}


def daemon_processes(pipe: str) -> list[int]:
    """Pids of MPS processes (real or stand-in) serving the pipe directory ``pipe``."""
    return _processes_with(pipe)


def wait_gone(pipe: str, timeout: float = 10.0) -> bool:
    """Whether every MPS process of ``pipe`` exited within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while _processes_with(pipe):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
