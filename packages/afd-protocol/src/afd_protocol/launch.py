"""Launch attention and FFN ranks as processes on one machine.

Used by tests, benchmarks and ``afd run``. Each rank runs ``target(connection, **kwargs)``
in its own process with its connection open (the shared-memory transport by default; any
backend through ``transport_factory``), and asks it for its endpoint; its return value
comes back to the caller through a pipe.

Rank processes come from multiprocessing's ``forkserver``: a clean server process (started
by the first launch, not forked from the caller) imports torch once, and forks every rank
from there -- the 1.5-3.7 s of CPU per rank that a fresh ``spawn`` interpreter spends
importing it (measured on a 2-core machine, idle and busy). Each rank gets
the caller's environment and ``sys.path`` as they are at the launch (applied before its
program runs, so a variable read at run time behaves as with ``spawn``; one read by torch
at import time sees the environment of the first launch). The server exits with the
caller; no GPU or CUDA state is ever created in it. Ranks that use GPUs are spawned as
fresh interpreters instead (``default_start_method=GPU_START_METHOD``: their exchange ran
faster per layer that way on an H200); ``AFD_START_METHOD`` (``forkserver`` or ``spawn``)
overrides either default.

Guarantees:

* when :func:`launch` returns or raises, every rank process is gone (terminated, then
  killed) and the rendezvous directory and any shared-memory segment it names are removed;
* a failing rank makes :func:`launch` raise :class:`LaunchError` naming every rank's
  outcome; a rank that raises sets its abort word first, so its peers fail fast;
* SIGTERM of the launching process is handled like Ctrl-C (``KeyboardInterrupt``, then the
  same cleanup), when :func:`launch` runs in the main thread;
* if the launching process dies without cleaning up (SIGKILL), its ranks do not outlive it:
  the fork server exits when its caller does, each rank gets SIGTERM from the kernel when
  its parent (the server) exits (``PR_SET_PDEATHSIG``), and every wait of a transport also
  checks that the launcher is alive (``AFD_SUPERVISOR``: the fallback where the signal is
  not available); the ranks then exit and the last ones remove the rendezvous directory;
* no semaphore or other named object is created: results travel through pipes, so nothing
  is left in ``/dev/shm`` by a crash;
* before a rank's program starts it knows every rank's pid (:func:`roster`), so waits
  outside a transport (a lockstep between replicas) can check their peers' liveness too.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.util
import os
import pickle
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

import torch

from afd_protocol.core.errors import AFDError, InvalidArgument
from afd_protocol.core.layout import WindowLayout
from afd_protocol.core.rendezvous import (
    SUPERVISOR_ENV,
    DirectoryStore,
    process_alive,
    process_start_time,
)
from afd_protocol.core.topology import Role
from afd_protocol.shm.segments import remove_segments
from afd_protocol.shm.transport import ShmTransport
from afd_protocol.transports import TransportFactory as TransportFactory  # defined there
from afd_protocol.window.connection import WindowConnection


def shm_transport(
    window: WindowLayout, role: Role, rank: int, rendezvous: str, connect_timeout: float
) -> WindowConnection:
    """The default factory: the shared-memory transport over the launcher's directory, as a
    :class:`~afd_protocol.window.WindowConnection` (the portable window endpoints)."""
    return WindowConnection(
        ShmTransport(window, role, rank, rendezvous, connect_timeout=connect_timeout)
    )


@dataclass(frozen=True)
class RankSpec:
    """What one rank runs: ``target(connection, **kwargs)`` (a module-level function), with
    ``env`` added to its process environment before anything else runs there (before CUDA
    starts: e.g. a CUDA MPS client's pipe directory and SM share)."""

    role: Role
    rank: int
    target: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{Role(self.role).value} rank {self.rank}"


@dataclass
class RankResult:
    """One rank's outcome."""

    name: str
    ok: bool
    value: Any = None
    error: str | None = None
    """``"ErrorType: message"`` when the rank failed."""
    error_type: str | None = None
    traceback: str | None = None
    pid: int | None = None


STOPPED_BY_SIGNAL = "StoppedBySignal"
"""``RankResult.error_type`` of a rank its SIGTERM handler stopped (:class:`StoppedBySignal`)."""
CONSEQUENCES = frozenset({"PeerAborted", "PeerTimeout", "ConnectorShutdown"})
"""Error types a rank raises because of another rank's failure (it aborted, died or went
silent), as opposed to a failure of its own."""


def _cause_first(result: RankResult) -> int:
    """Sort key of a failed rank in :class:`LaunchError`'s message: a rank stopped or
    killed by a signal first, then ranks that failed on their own, then those that only
    saw a peer fail, then those that merely did not stop in time."""
    if result.error_type == STOPPED_BY_SIGNAL or (result.error or "").startswith("killed by"):
        return 0
    if result.error_type in CONSEQUENCES:
        return 2
    if result.error_type is None and (result.error or "").startswith("did not "):
        return 3
    return 1


class LaunchError(AFDError):
    """At least one rank failed; ``results`` holds every rank's outcome by name. The
    message names the cause first (:func:`_cause_first`)."""

    def __init__(self, results: dict[str, RankResult]) -> None:
        self.results = results
        failed = sorted(self.failed(), key=_cause_first)
        lines = "; ".join(f"{r.name}: {r.error}{_raised_at(r.traceback)}" for r in failed)
        super().__init__(f"{len(failed)} of {len(results)} ranks failed: {lines}")

    def failed(self) -> list[RankResult]:
        return [r for r in self.results.values() if not r.ok]


def _raised_at(formatted: str | None) -> str:
    """`` (raised at FILE:LINE in FUNC)`` from a formatted traceback's innermost frame."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', formatted or "")
    if not frames:
        return ""
    path, line, func = frames[-1]
    return f" (raised at {os.path.basename(path)}:{line} in {func})"


_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int | bytes) -> bool:
    """Linux ``prctl(option, value)``; False where it is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def process_name(spec_name: str) -> str:
    """``"ffn rank 1"`` -> ``"afd-ffn1"``, the name a rank process shows in ``ps``."""
    role, _, rank = spec_name.split()
    return f"afd-{'attn' if role == 'attention' else role}{rank}"


_ROSTER: dict[str, tuple[int, int | None]] = {}


def roster() -> dict[str, tuple[int, int | None]]:
    """Inside a launched rank: every rank's ``(pid, start time)`` by name (``"ffn rank 1"``),
    known before the rank's program starts, so it can check any peer's liveness (with
    :func:`afd_protocol.core.rendezvous.process_alive`). Empty outside :func:`launch`."""
    return dict(_ROSTER)


def cleanup_rendezvous(rendezvous: str | Path) -> None:
    """Remove the shared-memory segments a rendezvous directory names, then the directory.

    Idempotent, and safe to run from several processes at once.
    """
    path = Path(rendezvous)
    if path.is_dir():
        with contextlib.suppress(OSError):
            store = DirectoryStore(path)
            records = [json.loads(r) for r in store.items("afd/rank/").values()]
            remove_segments(r["segment"] for r in records if "segment" in r)
    shutil.rmtree(path, ignore_errors=True)


class StoppedBySignal(SystemExit):
    """Raised in a rank by its SIGTERM handler: it unwinds like ``SystemExit`` (exit status
    ``128 + signal``) and is reported as ``stopped by SIGTERM``, not as an error of the
    rank's own."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


def _terminate(signum: int, frame: FrameType | None) -> None:
    """The first SIGTERM unwinds the rank (its finally blocks close the transport); a second
    one, or one during interpreter shutdown, just ends the process."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise StoppedBySignal(signum)


def _rank_main(
    spec: RankSpec,
    window: WindowLayout,
    rendezvous: str,
    connect_timeout: float,
    threads: int,
    results: multiprocessing.connection.Connection,
    factory: TransportFactory,
    launcher: tuple[int, int | None],
    control: multiprocessing.connection.Connection,
    environment: Mapping[str, str],
    server_dir: str | None,
) -> None:
    _detach_from_fork_server()
    os.environ.clear()  # the launcher's, not the fork server's (see the module docstring)
    os.environ.update(environment)
    os.environ.update(spec.env)
    tempfile.tempdir = None  # re-read TMPDIR, as a fresh interpreter would
    # Die with the launcher (SIGTERM from the kernel when it exits), and check it did not
    # exit before that was in place. SIGTERM unwinds through the finally blocks below, so
    # transports close; Ctrl-C reaches the whole process group, but the launcher decides.
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    os.environ[SUPERVISOR_ENV] = f"{launcher[0]}:{launcher[1]}"
    _prctl(_PR_SET_NAME, process_name(spec.name).encode()[:15])
    torch.set_num_threads(threads)
    try:
        if not process_alive(*launcher):
            raise SystemExit("the launcher exited before this rank started")
        _ROSTER.update(_receive_roster(control, connect_timeout))
        connection = factory(window, Role(spec.role), spec.rank, rendezvous, connect_timeout)
        try:
            value = spec.target(connection, **spec.kwargs)
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):
                connection.abort()  # peers fail fast instead of waiting for their timeouts
            raise
        finally:
            connection.close()
        # Pickled here with the standard pickler, so tensors travel by value: torch's
        # multiprocessing reducers would pass file descriptors that die with this process.
        _report(results, (spec.name, True, pickle.dumps(value), None, None, None, os.getpid()))
    except StoppedBySignal as exc:  # where it stood is not the story: who sent it is
        _report(results, (spec.name, False, None, str(exc), STOPPED_BY_SIGNAL, None, os.getpid()))
    except BaseException as exc:  # reported to the launcher, which decides
        message = f"{type(exc).__name__}: {exc}"
        report = (spec.name, False, None, message, type(exc).__name__, traceback.format_exc())
        _report(results, (*report, os.getpid()))
    finally:
        # Orphaned (the launcher is gone): nobody else will clean up.
        if not process_alive(*launcher):
            cleanup_rendezvous(rendezvous)
            if server_dir is not None:  # the dead launcher's fork-server socket
                shutil.rmtree(server_dir, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _receive_roster(
    control: multiprocessing.connection.Connection, timeout: float
) -> dict[str, tuple[int, int | None]]:
    """The roster the launcher sends once every rank process has started."""
    if not control.poll(timeout):
        raise SystemExit(f"no roster from the launcher within {timeout:g} s")
    try:
        received: dict[str, tuple[int, int | None]] = pickle.loads(control.recv_bytes())
    except EOFError:
        raise SystemExit("the launcher exited before this rank started") from None
    finally:
        control.close()
    return received


def _report(results: multiprocessing.connection.Connection, message: tuple[Any, ...]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: nobody to tell
        results.send_bytes(pickle.dumps(message))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} before reporting"


def launch(
    window: WindowLayout,
    ranks: Sequence[RankSpec],
    *,
    timeout: float = 300.0,
    connect_timeout: float = 60.0,
    grace: float = 10.0,
    threads_per_rank: int = 1,
    on_start: Callable[[dict[str, int]], None] | None = None,
    window_overrides: Mapping[str, WindowLayout] | None = None,
    transport_factory: TransportFactory = shm_transport,
    default_start_method: str = "forkserver",
) -> dict[str, RankResult]:
    """Run ``ranks`` to completion; see the module docstring.

    ``default_start_method`` (``"forkserver"`` or ``"spawn"``) is how the rank processes
    start unless ``AFD_START_METHOD`` says otherwise: GPU callers pass ``"spawn"`` (on one
    H200 the NVSHMEM exchange ran 0.83-0.91x as long per layer in spawned ranks as in ranks
    forked from the torch-importing server, ``docs/benchmarks.md``), CPU callers keep the
    fork server's faster start.

    ``timeout`` bounds the whole run; after the first failure the others get ``grace``
    seconds to fail fast (they normally do, through the abort word) before being killed.
    ``on_start`` receives ``{rank name: pid}`` once every process started (tests use it
    to kill a rank). ``window_overrides`` gives some ranks (by name) a different geometry,
    which only a test of the start-up handshake wants.
    """
    overrides = dict(window_overrides or {})
    ctx, server_dir = _rank_context(default_start_method)
    rendezvous = tempfile.mkdtemp(prefix="afd-rendezvous-")
    launcher = (os.getpid(), process_start_time(os.getpid()))
    processes: dict[str, Any] = {}
    readers: dict[multiprocessing.connection.Connection, str] = {}
    results: dict[str, RankResult] = {}
    try:
        with sigterm_as_interrupt():
            controls = []
            for spec in ranks:
                reader, writer = ctx.Pipe(duplex=False)
                control_reader, control = ctx.Pipe(duplex=False)
                process = ctx.Process(
                    target=_rank_main,
                    args=(
                        spec,
                        overrides.get(spec.name, window),
                        rendezvous,
                        connect_timeout,
                        threads_per_rank,
                        writer,
                        transport_factory,
                        launcher,
                        control_reader,
                        dict(os.environ),
                        server_dir,
                    ),
                    name=f"afd-{spec.name.replace(' ', '-')}",
                    daemon=True,
                )
                process.start()
                writer.close()  # the rank holds the only writer: its exit reads as EOF here
                control_reader.close()
                processes[spec.name] = process
                readers[reader] = spec.name
                controls.append(control)
            everyone = {name: (p.pid, process_start_time(p.pid)) for name, p in processes.items()}
            for control in controls:
                with contextlib.suppress(OSError):  # a rank that already died: reported below
                    control.send_bytes(pickle.dumps(everyone))
                control.close()
            if on_start is not None:
                on_start({name: p.pid for name, p in processes.items()})
            _collect(processes, readers, results, timeout, grace)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.terminate()
        for process in processes.values():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for reader in readers:
            reader.close()
        cleanup_rendezvous(rendezvous)
    if any(not r.ok for r in results.values()):
        raise LaunchError(results)
    return results


START_METHOD_ENV = "AFD_START_METHOD"
START_METHODS = ("forkserver", "spawn")
GPU_START_METHOD = "spawn"
"""How ranks that use GPUs start: on one H200 under MPS, NVSHMEM's dispatch + combine took
0.83-0.91x as long per layer in spawned ranks as in ranks forked from the fork server (two
rounds of each, side by side, ranges apart; ``docs/benchmarks.md``), which outweighs the
seconds of start-up that the fork server saves."""


def _rank_context(
    default: str,
) -> tuple[mp.context.ForkServerContext | mp.context.SpawnContext, str | None]:
    """The multiprocessing context ranks start from (``$AFD_START_METHOD``, else
    ``default``), and the directory of its fork server's socket (None for ``spawn``).

    The fork server imports torch and this module, nothing else: rank programs, transports
    and the libraries they load (CUDA, NVSHMEM, Triton) are imported in each rank, after
    its environment is in place, as with ``spawn``. The first launch of a process starts
    the server; it then serves every later launch, and exits with the process.
    """
    if default not in START_METHODS:
        raise InvalidArgument(f"the start method must be forkserver or spawn, got {default!r}")
    method = os.environ.get(START_METHOD_ENV, default)
    if method not in START_METHODS:
        raise AFDError(f"{START_METHOD_ENV} must be forkserver or spawn, got {method!r}")
    if method == "spawn":
        return mp.get_context("spawn"), None
    mp.set_forkserver_preload(["torch", __name__])
    multiprocessing.forkserver.ensure_running()
    return mp.get_context("forkserver"), multiprocessing.util.get_temp_dir()


def _detach_from_fork_server() -> None:
    """Close this rank's copy of the fork server's "alive" pipe. Every process the server
    forks inherits its write end, and the server exits only when all of them are closed:
    with the ranks' copies closed, it exits with the launcher, and its exit is what signals
    the ranks (``PR_SET_PDEATHSIG``). (CPython keeps the descriptor in the module's
    ``_forkserver`` object; a rank never starts processes through it.)"""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def _collect(
    processes: dict[str, Any],
    readers: dict[multiprocessing.connection.Connection, str],
    results: dict[str, RankResult],
    timeout: float,
    grace: float,
) -> None:
    """Read every rank's result as it comes (see :func:`launch` for the limits)."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    open_readers = dict(readers)
    while len(results) < len(processes):
        for ready in multiprocessing.connection.wait(list(open_readers), timeout=0.05):
            reader = cast(multiprocessing.connection.Connection, ready)
            name = open_readers.pop(reader)
            try:
                rank, ok, blob, error, error_type, tb, pid = pickle.loads(reader.recv_bytes())
                value = pickle.loads(blob) if blob is not None else None
                results[rank] = RankResult(rank, ok, value, error, error_type, tb, pid)
            except EOFError:  # it exited without reporting
                process = processes[name]
                process.join(timeout=5)
                results[name] = RankResult(
                    name, False, error=_describe_exit(process.exitcode), pid=process.pid
                )
        now = time.monotonic()
        if failed_at is None and any(not r.ok for r in results.values()):
            failed_at = now
        if failed_at is not None and now - failed_at > grace:
            break
        if now > deadline:
            break
    for name, process in processes.items():
        if name not in results:
            why = "did not finish" if failed_at is None else "did not stop"
            limit = timeout if failed_at is None else grace
            results[name] = RankResult(
                name, False, error=f"{why} within {limit:g} s", pid=process.pid
            )


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside this block (main thread only; elsewhere it
    changes nothing), so a terminated launcher cleans up exactly like an interrupted one.
    :func:`launch` runs in one; a caller holding something that must not outlive it (a
    helper daemon across several launches) opens another around them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
