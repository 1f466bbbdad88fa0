"""Ascend CAM transport for afd.

In progress. Done: a CPU emulator of CAM's compact routed-only communication operators
(:mod:`afd_transport_cam.emulator`: the four operators with their published schemas and
semantics, registered as ``torch.ops.afd_ascend.*``), their window geometry
(:mod:`afd_transport_cam.geometry`) and the per-token int8 quantisation
(:mod:`afd_transport_cam.quant`). Still to come: the afd endpoints over the operators, the
binding of the real NPU operators, the layer-select GEMM references, and windows shared
between processes.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-transport-cam")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = False
"""False until this package provides its functionality; callers can check it."""
