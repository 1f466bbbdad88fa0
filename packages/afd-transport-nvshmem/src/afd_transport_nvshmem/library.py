"""Finding ``libnvshmem_host.so.3``: an explicit path, or the NVIDIA wheels on sys.path.

Search order: ``AFD_NVSHMEM_LIB`` (a file path), then ``nvidia/nvshmem/lib`` inside every
``sys.path`` entry (where ``nvidia-nvshmem-cu12`` and ``nvidia-nvshmem-cu13`` install it).
When nothing is found the error names every place searched and the command that fixes it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from afd_protocol import AFDError

LIBRARY_NAME = "libnvshmem_host.so.3"
ENV_LIBRARY = "AFD_NVSHMEM_LIB"
INSTALL_HINT = (
    "pip install 'afd-transport-nvshmem[cu13]' for CUDA 13 (or '[cu12]' for CUDA 12), or "
    f"point {ENV_LIBRARY} at an existing {LIBRARY_NAME}"
)


class NvshmemUnavailable(AFDError):
    """The NVSHMEM host library cannot be found or loaded."""


def candidate_paths() -> list[Path]:
    """Every place the library is looked for, in order."""
    out = []
    for entry in sys.path:
        if entry:
            out.append(Path(entry) / "nvidia" / "nvshmem" / "lib" / LIBRARY_NAME)
    return out


def find_host_library() -> Path:
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise NvshmemUnavailable(f"{ENV_LIBRARY}={explicit} is not a file; {INSTALL_HINT}")
        return path
    searched = candidate_paths()
    for path in searched:
        if path.is_file():
            return path
    raise NvshmemUnavailable(
        f"{LIBRARY_NAME} not found (searched {ENV_LIBRARY} and {len(searched)} sys.path "
        f"entries under nvidia/nvshmem/lib); {INSTALL_HINT}"
    )
