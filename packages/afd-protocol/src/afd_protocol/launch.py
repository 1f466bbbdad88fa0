"""Launch attention and FFN ranks as processes on one machine.

Used by tests, benchmarks and ``afd run``. Each rank runs ``target(connection, **kwargs)``
in a fresh ``spawn`` process with its connection open (the shared-memory transport by
default; any backend through ``transport_factory``), and asks it for its endpoint; its
return value comes back to the caller. Guarantees: every process is gone when :func:`launch` returns
or raises (terminated, then killed), the rendezvous directory and any segment it names
are removed, and a failing rank makes :func:`launch` raise :class:`LaunchError` naming
every rank's outcome. A rank that raises sets its abort word first, so its peers fail
fast instead of waiting for their timeouts.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import queue
import re
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_protocol.core.endpoints import Connection
from afd_protocol.core.errors import AFDError
from afd_protocol.core.layout import WindowLayout
from afd_protocol.core.rendezvous import DirectoryStore
from afd_protocol.core.topology import Role
from afd_protocol.shm.segments import remove_segments
from afd_protocol.shm.transport import ShmTransport

TransportFactory = Callable[[WindowLayout, Role, int, str, float], Connection]
"""``factory(window, role, rank, rendezvous_dir, connect_timeout)`` opens one rank's
connection inside its process; it must be picklable (a module-level function, or a
``functools.partial`` of one), since spawn pickles it."""


def shm_transport(
    window: WindowLayout, role: Role, rank: int, rendezvous: str, connect_timeout: float
) -> Connection:
    """The default factory: the shared-memory transport over the launcher's directory."""
    return ShmTransport(window, role, rank, rendezvous, connect_timeout=connect_timeout)


@dataclass(frozen=True)
class RankSpec:
    """What one rank runs: ``target(connection, **kwargs)`` (a module-level function)."""

    role: Role
    rank: int
    target: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)

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


class LaunchError(AFDError):
    """At least one rank failed; ``results`` holds every rank's outcome by name."""

    def __init__(self, results: dict[str, RankResult]) -> None:
        self.results = results
        failed = [r for r in results.values() if not r.ok]
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


def _set_process_name(name: str) -> None:
    """Show the rank in ``ps``/``top`` (``/proc/PID/comm``, Linux; best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def process_name(spec_name: str) -> str:
    """``"ffn rank 1"`` -> ``"afd-ffn1"``, the name a rank process shows in ``ps``."""
    role, _, rank = spec_name.split()
    return f"afd-{'attn' if role == 'attention' else role}{rank}"


def _rank_main(
    spec: RankSpec,
    window: WindowLayout,
    rendezvous: str,
    connect_timeout: float,
    threads: int,
    results: Any,
    factory: TransportFactory,
) -> None:
    _set_process_name(process_name(spec.name))
    torch.set_num_threads(threads)
    try:
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
        results.put((spec.name, True, pickle.dumps(value), None, None, None, os.getpid()))
    except BaseException as exc:  # reported to the launcher, which decides
        message = f"{type(exc).__name__}: {exc}"
        results.put(
            (
                spec.name,
                False,
                None,
                message,
                type(exc).__name__,
                traceback.format_exc(),
                os.getpid(),
            )
        )


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
) -> dict[str, RankResult]:
    """Run ``ranks`` to completion; see the module docstring.

    ``timeout`` bounds the whole run; after the first failure the others get ``grace``
    seconds to fail fast (they normally do, through the abort word) before being killed.
    ``on_start`` receives ``{rank name: pid}`` once every process started (tests use it
    to kill a rank). ``window_overrides`` gives some ranks (by name) a different geometry,
    which only a test of the start-up handshake wants.
    """
    overrides = dict(window_overrides or {})
    ctx = mp.get_context("spawn")
    results_queue = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="afd-rendezvous-")
    processes: dict[str, Any] = {}
    results: dict[str, RankResult] = {}
    try:
        for spec in ranks:
            process = ctx.Process(
                target=_rank_main,
                args=(
                    spec,
                    overrides.get(spec.name, window),
                    rendezvous,
                    connect_timeout,
                    threads_per_rank,
                    results_queue,
                    transport_factory,
                ),
                name=f"afd-{spec.name.replace(' ', '-')}",
                daemon=True,
            )
            process.start()
            processes[spec.name] = process
        if on_start is not None:
            on_start({name: p.pid for name, p in processes.items()})
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        exited_without_result: dict[str, float] = {}
        while len(results) < len(processes):
            try:
                name, ok, blob, error, error_type, tb, pid = results_queue.get(timeout=0.05)
                value = pickle.loads(blob) if blob is not None else None
                results[name] = RankResult(name, ok, value, error, error_type, tb, pid)
            except queue.Empty:
                pass
            now = time.monotonic()
            for name, process in processes.items():
                if name in results or process.exitcode is None:
                    continue
                # Its result may still be in the pipe: give it a moment before judging.
                first_seen = exited_without_result.setdefault(name, now)
                if now - first_seen > 1.0:
                    results[name] = RankResult(
                        name, False, error=_describe_exit(process.exitcode), pid=process.pid
                    )
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
    finally:
        for process in processes.values():
            if process.is_alive():
                process.terminate()
        for process in processes.values():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        results_queue.close()
        records = [json.loads(r) for r in DirectoryStore(rendezvous).items("afd/rank/").values()]
        remove_segments(r["segment"] for r in records if "segment" in r)
        shutil.rmtree(rendezvous, ignore_errors=True)
    if any(not r.ok for r in results.values()):
        raise LaunchError(results)
    return results
