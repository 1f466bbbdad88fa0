"""CUDA MPS for several ranks on one GPU: a private control daemon and each rank's SM share.

NVSHMEM runs several PEs (processes) on one GPU fully only when they are clients of one
MPS server and their active-thread percentages on that GPU add up to at most 100 ("full
MPG"); without MPS ("limited MPG") its barriers and stream signal waits abort the PE, and
with more than 100 % its synchronising calls may deadlock. One GPU per rank stays the
production layout; several per GPU is how one GPU measures the fixed costs, kernels and
asynchrony of a whole deployment.

:class:`MpsDaemon` is the one object a launcher holds:

* :meth:`MpsDaemon.start` uses a daemon that already answers on ``CUDA_MPS_PIPE_DIRECTORY``
  (left running at close), or starts a private one: ``nvidia-cuda-mps-control -d`` with
  pipe and log directories of its own (0700, in a fresh temporary directory), so it can
  neither collide with nor be mistaken for anyone else's;
* :meth:`MpsDaemon.client_environment` is what a rank process needs in its environment
  before CUDA starts (the pipe directory and its ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``);
* :meth:`MpsDaemon.close` (also on failure, as a context manager) stops a daemon it
  started -- ``quit`` to the control daemon, then waiting, bounded, for the control daemon
  and its server to exit, SIGKILL after that -- and removes its directories. The GPU's
  compute mode is never read or changed.

Every wait is bounded and every failure names what to do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from afd_protocol import AFDError, TopologyError

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
"""Where CUDA clients look for the daemon when ``CUDA_MPS_PIPE_DIRECTORY`` is unset."""
SEARCH = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/cuda/bin")
"""Where the control binary lives when it is not on ``PATH`` (the driver's directories)."""
HOW_TO = (
    "start one with `nvidia-cuda-mps-control -d` (with CUDA_MPS_PIPE_DIRECTORY and "
    "CUDA_MPS_LOG_DIRECTORY set to directories of yours), give each rank "
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE so that a GPU's ranks add up to at most 100, and stop "
    "it with `echo quit | nvidia-cuda-mps-control`; afd run and afd bench do all of this "
    "when they place several ranks on one GPU"
)


class MpsError(AFDError):
    """MPS could not be found, started, used or stopped; the message says what to do."""


def find_control(search: Sequence[str] = SEARCH) -> str:
    """The path of ``nvidia-cuda-mps-control`` (``PATH`` first, then the driver's
    directories), or :class:`MpsError` saying what is missing."""
    found = shutil.which(CONTROL)
    if found:
        return found
    for directory in search:
        candidate = Path(directory) / CONTROL
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise MpsError(
        f"{CONTROL} was not found on PATH or in {', '.join(search)}: several ranks on one GPU "
        f"need CUDA MPS, which comes with the NVIDIA driver; install the driver's utilities "
        f"or give every rank its own GPU"
    )


def client_share(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's SM share as an MPS client (percent), or None when no MPS daemon
    answers on its pipe directory (the process is then not an MPS client). A client
    without ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` may use every SM: 100."""
    env = os.environ if environ is None else environ
    pipe = Path(env.get(PIPE_ENV) or DEFAULT_PIPE_DIRECTORY)
    if not (pipe / "control").exists():
        return None
    raw = env.get(SHARE_ENV, "").strip()
    if not raw:
        return 100
    try:
        share = int(float(raw))
    except ValueError:
        raise MpsError(f"{SHARE_ENV}={raw!r} is not a percentage; give 1 to 100") from None
    if not 1 <= share <= 100:
        raise MpsError(f"{SHARE_ENV}={raw!r} is out of range; give 1 to 100")
    return share


def check_gpu_sharing(
    gpus: Mapping[int, str], shares: Mapping[int, int | None], name: Callable[[int], str]
) -> None:
    """Refuse a GPU shared by ranks unless every one of them is an MPS client and their
    shares add up to at most 100 (``gpus`` and ``shares``: world rank -> GPU id, share;
    ``name``: a world rank's name). Every rank checks the same data, so all refuse alike."""
    by_gpu: dict[str, list[int]] = {}
    for world, gpu in sorted(gpus.items()):
        by_gpu.setdefault(gpu, []).append(world)
    for ranks in by_gpu.values():
        if len(ranks) < 2:
            continue
        names = " and ".join(name(w) for w in ranks)
        outside = [w for w in ranks if shares.get(w) is None]
        if outside:
            raise TopologyError(
                f"{names} would share a GPU, but {' and '.join(name(w) for w in outside)} "
                f"{'is not a CUDA MPS client' if len(outside) == 1 else 'are not CUDA MPS clients'}"
                f": NVSHMEM then "
                f"supports only some calls and a rank would abort or hang; {HOW_TO}"
            )
        total = sum(int(shares[w] or 0) for w in ranks)
        if total > 100:
            listed = ", ".join(f"{name(w)} {shares[w]} %" for w in ranks)
            raise TopologyError(
                f"{names} share a GPU with MPS shares adding up to {total} % ({listed}): "
                f"above 100 NVSHMEM's synchronising calls may deadlock; lower them"
            )


VERIFIED_SHARES = (100, 50, 25)
"""SM shares whose results were right on our GPU host. Measured 2026-12-02 on one H200
(torch 2.11 + CUDA 13, driver 580): as an MPS client at 33 and 40 % (42 and 52 SMs) cuBLAS
leaves elements of bf16 GEMM outputs unwritten for most row counts of every V2-Lite
projection (the model came out NaN there, and at 45 and 60 %), at 25, 50 and 100 % (32, 66,
132 SMs) it writes them all. The GEMM probe refused 37 and 75 % too (48 and 98 SMs: 18 and
29 of its 98 products, the same day). So the default split uses these shares; any other can still be
asked for, and a rank on a share whose GEMMs drop outputs stops at start-up
(``afd_models.check_gemms_write_every_output``)."""


def equal_shares(ranks_per_gpu: int) -> int:
    """Each rank's share when ``ranks_per_gpu`` ranks split a GPU evenly: the largest of
    :data:`VERIFIED_SHARES` that fits (``100 // ranks_per_gpu`` below the smallest)."""
    if ranks_per_gpu < 1:
        raise ValueError(f"ranks_per_gpu must be >= 1, got {ranks_per_gpu}")
    even = 100 // ranks_per_gpu
    fitting = [share for share in VERIFIED_SHARES if share <= even]
    return max(fitting) if fitting else even


def _processes_with(pipe: str) -> list[int]:
    """Processes whose environment names ``pipe`` as their MPS pipe directory and whose
    command is MPS's own (the control daemon and its server)."""
    found = []
    wanted = f"{PIPE_ENV}={pipe}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if not comm.startswith("nvidia-cuda-mps"):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environ:
            found.append(int(entry.name))
    return found


@dataclass
class MpsDaemon:
    """An MPS control daemon this process uses (module docstring)."""

    pipe_directory: str
    log_directory: str
    owned: bool
    """Started here (and stopped by :meth:`close`), rather than found running."""
    control: str
    scratch: str | None = None
    """The temporary directory holding a private daemon's pipe and log directories."""
    closed: bool = False

    @classmethod
    def start(
        cls,
        *,
        timeout: float = 30.0,
        control: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> MpsDaemon:
        """Use the daemon answering on ``CUDA_MPS_PIPE_DIRECTORY`` if one does, else start a
        private one; :class:`MpsError` if it does not come up within ``timeout`` s."""
        env = dict(os.environ if environ is None else environ)
        binary = control or find_control()
        existing = env.get(PIPE_ENV)
        if existing and _answers(binary, existing, env, timeout):
            log = env.get(LOG_ENV, "")
            return cls(existing, log, owned=False, control=binary)
        scratch = tempfile.mkdtemp(prefix="afd-mps-")
        pipe, log = os.path.join(scratch, "pipe"), os.path.join(scratch, "log")
        for directory in (pipe, log):
            os.mkdir(directory, 0o700)
        daemon = cls(pipe, log, owned=True, control=binary, scratch=scratch)
        try:
            # Its output goes to a file, not a pipe: a daemon that kept the pipe open would
            # make the wait for the starter's end never finish.
            said = Path(scratch) / "start.out"
            with said.open("w+") as out:
                started = subprocess.run(
                    [binary, "-d"],
                    env={**env, PIPE_ENV: pipe, LOG_ENV: log},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                    check=False,
                )
            if started.returncode != 0:
                raise MpsError(
                    f"{binary} -d exited with {started.returncode}: "
                    f"{said.read_text(errors='replace').strip()[:400]}; {HOW_TO}"
                )
            deadline = time.monotonic() + timeout
            while not (Path(pipe) / "control").exists():
                if time.monotonic() > deadline:
                    raise MpsError(
                        f"the MPS control daemon did not open {pipe}/control within "
                        f"{timeout:g} s; see {log}/control.log"
                    )
                time.sleep(0.02)
        except BaseException:
            daemon.close(timeout=min(timeout, 5.0))  # whatever it started, and the directories
            raise
        return daemon

    def client_environment(self, share: int | None) -> dict[str, str]:
        """What a rank needs in its environment before CUDA starts to be this daemon's
        client with ``share`` percent of the SMs (None: all of them)."""
        if share is not None and not 1 <= share <= 100:
            raise MpsError(f"an MPS share is 1 to 100 percent, got {share}")
        env = {PIPE_ENV: self.pipe_directory}
        if self.log_directory:
            env[LOG_ENV] = self.log_directory
        if share is not None:
            env[SHARE_ENV] = str(share)
        return env

    def close(self, timeout: float = 15.0) -> None:
        """Stop a daemon this object started (bounded; SIGKILL after ``timeout`` s) and
        remove its directories; a daemon found running is left alone. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self.owned:
            return
        env = {**os.environ, PIPE_ENV: self.pipe_directory, LOG_ENV: self.log_directory}
        try:
            if (Path(self.pipe_directory) / "control").exists():
                with contextlib.suppress(subprocess.TimeoutExpired):  # then killed below
                    subprocess.run(
                        [self.control],
                        input="quit\n",
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                        check=False,
                    )
            deadline = time.monotonic() + timeout
            while _processes_with(self.pipe_directory) and time.monotonic() < deadline:
                time.sleep(0.05)
            for pid in _processes_with(self.pipe_directory):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> MpsDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answers(binary: str, pipe: str, env: Mapping[str, str], timeout: float) -> bool:
    """Whether a control daemon answers on ``pipe`` (``get_server_list`` succeeds)."""
    if not (Path(pipe) / "control").exists():
        return False
    try:
        reply = subprocess.run(
            [binary],
            input="get_server_list\n",
            env={**env, PIPE_ENV: pipe},
            capture_output=True,
            text=True,
            timeout=min(timeout, 10.0),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False
    return reply.returncode == 0
