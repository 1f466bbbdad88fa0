"""afd-protocol: the contract between attention and FFN ranks in asynchronous AFD.

Pure Python on torch tensors, device-agnostic, no vLLM and no CUDA. Any engine or
transport can build on it. This namespace is the contract core (:mod:`afd_protocol.core`):

* :class:`Topology`, :class:`ExpertPlacement`, :class:`Role` -- who talks to whom.
* :class:`SlotLayout`, :class:`WindowLayout` -- where every byte of a window lives, the
  capacities, and the geometry both roles compare at start-up.
* :func:`encode_header` / :func:`decode_header` -- the in-band metadata of every slot.
* :func:`plan_dispatch` / :func:`plan_on_device` / :func:`combine_scatter` /
  :func:`combine` -- routing partials to FFN ranks with one stable sort, and the fp32
  weighted combine of their replies.
* :class:`AttentionEndpoint`, :class:`FFNEndpoint`, :class:`Connection` (and
  :class:`RankConnection`, a base holding a rank's identity),
  :class:`EndpointOptions` -- the protocols every backend implements; :class:`WorkItem`
  -- what an FFN rank serves; :func:`serve` -- the one FFN serving loop;
  :func:`freeze_heap` -- keep the garbage collector's full passes off the serving path.
* :class:`Rendezvous` over a :class:`KeyValueStore` -- start-up and shutdown agreement;
  :func:`check_supervisor` -- a rank's wait loop stops once its launcher is gone.
* The transport registry (:mod:`afd_protocol.transports`): :func:`get_transport`,
  :func:`available_transports` -- every installed transport as a :class:`TransportSpec`
  (its devices, :class:`DeviceSharing`, pip requirement, and the launcher factory it builds
  from a :class:`SlotLayout` and :class:`TransportOptions`), found through the entry-point
  group ``afd.transports``.
* The error hierarchy rooted at :class:`AFDError`.

Layers above it, imported by their own names (``import-linter`` keeps the direction):
:mod:`afd_protocol.window` (bytes-and-flags transports and the endpoints over them),
:mod:`afd_protocol.shm` (the shared-memory transport), :mod:`afd_protocol.launch`
(ranks as processes on one machine) and :mod:`afd_protocol.testing` (linear experts and
an independent reference, for checking any backend).
"""

from importlib.metadata import PackageNotFoundError, version

from afd_protocol.core.endpoints import (
    AttentionEndpoint,
    Connection,
    DispatchHandle,
    EndpointOptions,
    FFNEndpoint,
    RankConnection,
    check_dispatch_inputs,
)
from afd_protocol.core.errors import (
    AFDError,
    CapacityError,
    ConnectorShutdown,
    InvalidArgument,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    RingExhausted,
    TopologyError,
    TransportUnavailable,
)
from afd_protocol.core.extents import Extent, ExtentRule, extent_rules, used_extents
from afd_protocol.core.header import (
    FLAG_ABORT,
    FLAG_ROWS_PER_TOKEN,
    FLAG_SHUTDOWN,
    HEADER_FIXED_WORDS,
    KNOWN_FLAGS,
    MAGIC,
    PROTOCOL_VERSION,
    SEQ_LIMIT,
    Header,
    HeaderLimits,
    MessageKind,
    Word,
    checksum,
    crc_columns,
    decode_header,
    encode_fixed_words,
    encode_header,
    encode_words,
    next_seq,
)
from afd_protocol.core.heap import freeze_heap
from afd_protocol.core.layout import (
    ALIGN,
    CombineReduce,
    FieldSpec,
    SharedPlacement,
    SlotLayout,
    WindowLayout,
    WireFormat,
    check_same_geometry,
)
from afd_protocol.core.plan import (
    DevicePlan,
    DispatchPlan,
    WireOrder,
    check_expert_bounds,
    combine,
    combine_reduced,
    combine_scatter,
    expert_ids_from_counts,
    new_accumulator,
    plan_dispatch,
    plan_on_device,
    shared_token_split,
    wire_table,
)
from afd_protocol.core.rendezvous import (
    DirectoryStore,
    KeyValueStore,
    PeerRecord,
    Rendezvous,
    TcpStore,
    check_supervisor,
    process_alive,
    process_start_time,
    supervisor_from_env,
)
from afd_protocol.core.serving import Compute, ItemRecord, ServeStats, serve
from afd_protocol.core.tensors import (
    constant_index,
    keeping_constants,
    relative_error,
    torch_dtype,
)
from afd_protocol.core.topology import ExpertPlacement, Role, Topology
from afd_protocol.core.workitem import (
    PartialsReduce,
    PartialsToReduce,
    WorkItem,
    WorkItemKey,
    WorkItemPart,
    reference_reduce_partials,
)
from afd_protocol.shm.segments import SharedSegment, share_segments
from afd_protocol.shm.segments import check_platform as check_shared_memory_platform
from afd_protocol.shm.transport import ShmTransport
from afd_protocol.transports import (
    FIRST_PARTY_TRANSPORTS,
    DeviceSharing,
    TransportFactory,
    TransportOptions,
    TransportSpec,
    available_transports,
    get_transport,
    transport_names,
)

try:
    __version__ = version("afd-protocol")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ALIGN",
    "FIRST_PARTY_TRANSPORTS",
    "FLAG_ABORT",
    "FLAG_ROWS_PER_TOKEN",
    "FLAG_SHUTDOWN",
    "HEADER_FIXED_WORDS",
    "KNOWN_FLAGS",
    "MAGIC",
    "PROTOCOL_VERSION",
    "SEQ_LIMIT",
    "AFDError",
    "AttentionEndpoint",
    "CapacityError",
    "CombineReduce",
    "Compute",
    "Connection",
    "ConnectorShutdown",
    "DevicePlan",
    "DeviceSharing",
    "DirectoryStore",
    "DispatchHandle",
    "DispatchPlan",
    "EndpointOptions",
    "ExpertPlacement",
    "Extent",
    "ExtentRule",
    "FFNEndpoint",
    "FieldSpec",
    "Header",
    "HeaderLimits",
    "InvalidArgument",
    "ItemRecord",
    "KeyValueStore",
    "MessageKind",
    "PartialsReduce",
    "PartialsToReduce",
    "PeerAborted",
    "PeerRecord",
    "PeerTimeout",
    "ProtocolError",
    "RankConnection",
    "Rendezvous",
    "RingExhausted",
    "Role",
    "ServeStats",
    "SharedPlacement",
    "SharedSegment",
    "ShmTransport",
    "SlotLayout",
    "TcpStore",
    "Topology",
    "TopologyError",
    "TransportFactory",
    "TransportOptions",
    "TransportSpec",
    "TransportUnavailable",
    "WindowLayout",
    "WireFormat",
    "WireOrder",
    "Word",
    "WorkItem",
    "WorkItemKey",
    "WorkItemPart",
    "__version__",
    "available_transports",
    "check_dispatch_inputs",
    "check_expert_bounds",
    "check_same_geometry",
    "check_shared_memory_platform",
    "check_supervisor",
    "checksum",
    "combine",
    "combine_reduced",
    "combine_scatter",
    "constant_index",
    "crc_columns",
    "decode_header",
    "encode_fixed_words",
    "encode_header",
    "encode_words",
    "expert_ids_from_counts",
    "extent_rules",
    "freeze_heap",
    "get_transport",
    "keeping_constants",
    "new_accumulator",
    "next_seq",
    "plan_dispatch",
    "plan_on_device",
    "process_alive",
    "process_start_time",
    "reference_reduce_partials",
    "relative_error",
    "serve",
    "share_segments",
    "shared_token_split",
    "supervisor_from_env",
    "torch_dtype",
    "transport_names",
    "used_extents",
    "wire_table",
]
