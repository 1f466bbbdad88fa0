"""Ascend CAM transport for afd.

In progress. Done: a CPU emulator of CAM's compact routed-only communication operators
(:mod:`afd_transport_cam.emulator`: the four operators with their published schemas and
semantics, registered as ``torch.ops.afd_ascend.*``, over windows in this process or shared
between processes), their window geometry (:mod:`afd_transport_cam.geometry`), the
per-token int8 quantisation (:mod:`afd_transport_cam.quant`), and afd's endpoint protocols
over the operators (:mod:`afd_transport_cam.endpoints`; :mod:`afd_transport_cam.emulated`
opens a rank's connection for afd's launcher). Still to come: the binding of the real NPU
operators and the layer-select GEMM references.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-transport-cam")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = False
"""False until this package provides its functionality; callers can check it."""
