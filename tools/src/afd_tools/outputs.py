"""Output files of ``afd run``: checked before the run starts, written atomically after it,
so a finished run is never lost to a bad path and a reader never sees half a file."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from afd_tools.prefill.workload import WorkloadError


def check_writable(path: Path | None) -> None:
    """Raise :class:`WorkloadError` unless ``path`` can be written (None: nothing to check)."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise WorkloadError(f"{path} is a directory; give a file name to write to")
    if not folder.is_dir():
        raise WorkloadError(f"cannot write {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise WorkloadError(f"cannot write {path}: the directory {folder} is not writable")


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary path)`` beside ``path``, then rename it into place."""
    folder = path.parent if str(path.parent) else Path(".")
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=folder)
    os.close(handle)
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite written as the string ``"nan"``,
    ``"inf"`` or ``"-inf"`` (dicts, lists and tuples walked), so that ``json.dumps(...,
    allow_nan=False)`` writes valid JSON and a reader sees the value for what it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value
