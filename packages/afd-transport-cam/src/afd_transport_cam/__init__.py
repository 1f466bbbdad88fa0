"""Ascend CAM transport for afd.

Done (tested on CPU; never run on an NPU): a CPU emulator of CAM's compact routed-only
communication operators (:mod:`afd_transport_cam.emulator`: the four operators with their
published schemas and semantics, registered as ``torch.ops.afd_ascend.*``, over windows in
this process or shared between processes), their window geometry
(:mod:`afd_transport_cam.geometry`), the per-token int8 quantisation
(:mod:`afd_transport_cam.quant`), afd's endpoint protocols over the operators
(:mod:`afd_transport_cam.endpoints`; :mod:`afd_transport_cam.emulated` opens a rank's
connection for afd's launcher), the graph-mode FFN loop (:mod:`afd_transport_cam.graph_ffn`),
the layer-select GEMM references (:mod:`afd_transport_cam.emulator.gemm`) and the lazy
binding of the real operators (:mod:`afd_transport_cam.binding`, :mod:`afd_transport_cam.npu`).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-transport-cam")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = True
"""This package provides its functionality (on CPU through the emulator; the real NPU
operators load through :func:`afd_transport_cam.binding.load_npu_operators`)."""
