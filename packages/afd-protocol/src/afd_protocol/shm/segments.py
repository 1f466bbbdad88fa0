"""POSIX shared-memory segments for host windows: private, randomly named, never leaked.

A segment is a file in ``/dev/shm`` created with ``O_EXCL`` and mode 0600 (only this
user can open it), under a random name, and mapped ``MAP_SHARED`` through
``torch.from_file``, so the mapping lives exactly as long as the tensors over it.

Leak freedom rests on one rule: the creator unlinks the name as soon as every peer has
mapped the segment (the rendezvous tells it when). From then on the memory is owned by
the mappings alone and the kernel frees it when the last process holding one exits, by
``close()``, by an exception or by SIGKILL. The short window between create and unlink
is covered by :func:`remove_segments` (the launcher calls it at teardown) and by
``close()`` on every failure path.
"""

from __future__ import annotations

import os
import platform
import re
import secrets
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from afd_protocol.core.errors import AFDError
from afd_protocol.core.rendezvous import Rendezvous

SHM_DIR = Path("/dev/shm")
PREFIX = "afd-"
"""Every afd segment's name starts with this (the only names afd maps or removes)."""
NAMESPACE_ENV = "AFD_SHM_NAMESPACE"
_NAMESPACE = re.compile(r"[A-Za-z0-9_]{1,32}")


def segment_prefix() -> str:
    """The prefix of the segments this process creates and :func:`leftover_segments` lists:
    ``afd-``, or ``afd-NAME-`` when ``AFD_SHM_NAMESPACE=NAME`` is set (inherited by every
    rank a launcher starts), so that deployments or test runs sharing ``/dev/shm`` can
    tell their segments apart -- a leak check of one then never sees another's."""
    name = os.environ.get(NAMESPACE_ENV, "")
    if not name:
        return PREFIX
    if not _NAMESPACE.fullmatch(name):
        raise AFDError(
            f"{NAMESPACE_ENV}={name!r}: use 1 to 32 letters, digits or underscores, or unset it"
        )
    return f"{PREFIX}{name}-"


def check_platform() -> None:
    """Refuse to run where the host transport's memory-ordering argument does not hold."""
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        raise AFDError(
            f"the host transport needs Linux on x86-64 (whose total store order makes a "
            f"visible flag imply a complete payload); this is {sys.platform}/{machine}. Use a "
            f"device transport here, or run the host transport on an x86-64 Linux machine"
        )
    if not SHM_DIR.is_dir():
        raise AFDError(f"{SHM_DIR} is missing; the host transport needs POSIX shared memory")


class SharedSegment:
    """One shared-memory file and this process's mapping of it."""

    def __init__(self, path: Path, size: int, tensor: torch.Tensor, owner: bool) -> None:
        self.path = path
        self.size = size
        self.tensor: torch.Tensor | None = tensor
        self.owner = owner

    @classmethod
    def create(cls, size: int, tag: str) -> SharedSegment:
        path = SHM_DIR / f"{segment_prefix()}{tag}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise AFDError(f"cannot size shared memory {path} to {size} bytes: {exc}") from exc
        os.close(fd)
        try:
            tensor = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return cls(path, size, tensor, owner=True)

    @classmethod
    def attach(cls, path: Path, size: int) -> SharedSegment:
        """Map a peer's segment; it must exist, be ours, private, and large enough."""
        if path.parent != SHM_DIR or not path.name.startswith(PREFIX):
            raise AFDError(f"refusing to map {path}: not an afd shared-memory segment")
        try:
            info = path.stat()
        except FileNotFoundError:
            raise AFDError(
                f"shared memory {path} vanished before it was mapped; its owner exited or "
                f"unlinked it early"
            ) from None
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise AFDError(f"refusing to map {path}: it is not private to this user (mode 0600)")
        if info.st_size < size:
            raise AFDError(f"shared memory {path} has {info.st_size} bytes, expected {size}")
        tensor = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        return cls(path, size, tensor, owner=False)

    def unlink(self) -> None:
        """Remove the name (owner only); existing mappings stay valid. Idempotent."""
        if self.owner:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop this process's mapping (freed once no tensor view refers to it)."""
        self.unlink()
        self.tensor = None


def remove_segments(paths: Iterable[str | Path]) -> list[Path]:
    """Unlink afd segments that still exist (a teardown guard); returns what was removed."""
    removed = []
    for raw in paths:
        path = Path(raw)
        if path.parent == SHM_DIR and path.name.startswith(PREFIX) and path.exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def leftover_segments() -> list[Path]:
    """This namespace's afd segments currently in /dev/shm (:func:`segment_prefix`; for
    tests and diagnostics)."""
    return sorted(SHM_DIR.glob(f"{segment_prefix()}*")) if SHM_DIR.is_dir() else []


def share_segments(
    rendezvous: Rendezvous,
    size: int,
    geometry: Mapping[str, object],
    peers: Sequence[int],
    timeout: float,
) -> tuple[SharedSegment, dict[int, SharedSegment]]:
    """Create this rank's segment, map every peer's, and drop the name once all mapped.

    The rendezvous compares ``geometry`` with every peer's (``peers``: world ranks) and
    carries each segment's path; after the ``attached`` barrier nothing can leak (module
    docstring). On any failure this rank's failure is published, everything mapped so far is
    released, and the error propagates. Returns ``(own, {peer world rank: segment})``.
    """
    own: SharedSegment | None = None
    attached: dict[int, SharedSegment] = {}
    try:
        own = SharedSegment.create(size, tag=f"w{rendezvous.world_rank}")
        records = rendezvous.join(geometry, peers, timeout, segment=str(own.path))
        for peer in peers:
            attached[peer] = SharedSegment.attach(Path(records[peer].extra["segment"]), size)
        rendezvous.barrier("attached", peers, timeout)
        own.unlink()  # every peer mapped it: from here on the mappings own the memory
    except BaseException as exc:
        rendezvous.fail(str(exc) or type(exc).__name__)
        for segment in (own, *attached.values()):
            if segment is not None:
                segment.close()
        raise
    return own, attached
