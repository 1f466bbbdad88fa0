"""NVSHMEM transport for afd on NVIDIA GPUs.

Not implemented yet (issue: afd-transport-nvshmem). It will bind ``libnvshmem_host.so.3``
with ctypes, bootstrap NVSHMEM on a key-value store, map peer windows with
``nvshmem_ptr`` and implement the afd transport interface with device-side waits.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-transport-nvshmem")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = False
"""False until this package provides its functionality; callers can check it."""
