"""Ascend CAM transport for afd.

Not implemented yet. It will bind the CAM asynchronous operators (four communication
operators, two layer-select routed-expert operators) behind the afd transport interface
and ship a CPU emulator of their semantics so the connector logic is tested without an NPU.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-transport-cam")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = False
"""False until this package provides its functionality; callers can check it."""
