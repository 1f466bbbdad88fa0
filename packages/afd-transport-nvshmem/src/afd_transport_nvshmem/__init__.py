"""afd-transport-nvshmem: the afd transport on NVIDIA GPUs over NVSHMEM.

Import is cheap and works without CUDA or NVSHMEM: the library is located and loaded only
when a transport or :class:`NvshmemLibrary` is created, so errors say what to install.
"""

from importlib.metadata import PackageNotFoundError, version

from afd_transport_nvshmem.binding import STRUCT_SIZES, NvshmemLibrary
from afd_transport_nvshmem.bootstrap import SINGLE_NODE_DEFAULTS, apply_single_node_defaults
from afd_transport_nvshmem.library import NvshmemUnavailable, find_host_library

try:
    __version__ = version("afd-transport-nvshmem")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"


def __getattr__(name: str) -> object:
    # torch.cuda helpers only when asked
    if name in ("NvshmemConnection", "NvshmemTransport", "NvshmemOptions"):
        from afd_transport_nvshmem import transport

        return getattr(transport, name)
    if name == "GraphedAttentionEndpoint":
        from afd_transport_nvshmem import graphed_attention

        return graphed_attention.GraphedAttentionEndpoint
    if name in ("GraphedFFNServer", "ServeGraphOptions"):
        from afd_transport_nvshmem import graphed_ffn  # Triton loads here

        return getattr(graphed_ffn, name)
    raise AttributeError(name)


__all__ = [
    "SINGLE_NODE_DEFAULTS",
    "STRUCT_SIZES",
    "GraphedAttentionEndpoint",
    "GraphedFFNServer",
    "NvshmemConnection",
    "NvshmemLibrary",
    "NvshmemOptions",
    "NvshmemTransport",
    "NvshmemUnavailable",
    "ServeGraphOptions",
    "__version__",
    "apply_single_node_defaults",
    "find_host_library",
]
