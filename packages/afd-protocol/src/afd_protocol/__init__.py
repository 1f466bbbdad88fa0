"""afd-protocol: the contract between attention and FFN ranks in asynchronous AFD.

Pure Python on torch tensors, device-agnostic, no vLLM and no CUDA. Any engine or
transport can build on it:

* :class:`Topology`, :class:`ExpertPlacement`, :class:`Role` -- who talks to whom.
* :class:`SlotLayout`, :class:`WindowLayout` -- where every byte of a window lives, the
  capacities, and the geometry digest both roles compare at start-up.
* :func:`encode_header` / :func:`decode_header` -- the in-band metadata of every slot.
* :func:`plan_dispatch` / :func:`combine_scatter` / :func:`combine` -- routing partials
  to FFN ranks with one stable sort, and the fp32 weighted combine of their replies.
* :class:`Transport` -- the interface a backend implements; :class:`AttentionEndpoint`
  and :class:`FFNEndpoint` -- dispatch/combine and work-item intake/reply over it.
* :mod:`afd_protocol.host` -- the host shared-memory transport and a process launcher.
* :class:`WorkItem`, :class:`PendingDispatch` -- the work-item contract's types.
* The error hierarchy rooted at :class:`AFDError`.
"""

from importlib.metadata import PackageNotFoundError, version

from afd_protocol.attention_endpoint import AttentionEndpoint
from afd_protocol.device_pack import (
    DevicePack,
    DevicePlan,
    PackInputs,
    plan_on_device,
    reference_device_pack,
)
from afd_protocol.errors import (
    AFDError,
    CapacityError,
    ConnectorShutdown,
    PeerAborted,
    PeerTimeout,
    ProtocolError,
    TopologyError,
)
from afd_protocol.ffn_endpoint import FFNEndpoint
from afd_protocol.fused import CombineInputs, FusedCombine, reference_fused_combine
from afd_protocol.header import (
    FLAG_ABORT,
    FLAG_SHUTDOWN,
    HEADER_FIXED_WORDS,
    MAGIC,
    PROTOCOL_VERSION,
    Header,
    HeaderLimits,
    MessageKind,
    Word,
    decode_header,
    encode_header,
    encode_words,
)
from afd_protocol.layout import (
    ALIGN,
    FieldSpec,
    SharedPlacement,
    SlotLayout,
    WindowLayout,
    check_same_geometry,
)
from afd_protocol.loopback import LoopbackTransport, LoopbackWorld
from afd_protocol.plan import (
    DispatchPlan,
    combine,
    combine_scatter,
    expert_ids_from_counts,
    new_accumulator,
    plan_dispatch,
)
from afd_protocol.topology import ExpertPlacement, Role, Topology
from afd_protocol.transport import Transport
from afd_protocol.views import SlotView, abort_words, flag_words, slot_view, torch_dtype
from afd_protocol.workitem import PendingDispatch, WorkItem, WorkItemKey, WorkItemPart

try:
    __version__ = version("afd-protocol")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ALIGN",
    "FLAG_ABORT",
    "FLAG_SHUTDOWN",
    "HEADER_FIXED_WORDS",
    "MAGIC",
    "PROTOCOL_VERSION",
    "AFDError",
    "AttentionEndpoint",
    "CapacityError",
    "CombineInputs",
    "ConnectorShutdown",
    "DevicePack",
    "DevicePlan",
    "DispatchPlan",
    "ExpertPlacement",
    "FFNEndpoint",
    "FieldSpec",
    "FusedCombine",
    "Header",
    "HeaderLimits",
    "LoopbackTransport",
    "LoopbackWorld",
    "MessageKind",
    "PackInputs",
    "PeerAborted",
    "PeerTimeout",
    "PendingDispatch",
    "ProtocolError",
    "Role",
    "SharedPlacement",
    "SlotLayout",
    "SlotView",
    "Topology",
    "TopologyError",
    "Transport",
    "WindowLayout",
    "Word",
    "WorkItem",
    "WorkItemKey",
    "WorkItemPart",
    "__version__",
    "abort_words",
    "check_same_geometry",
    "combine",
    "combine_scatter",
    "decode_header",
    "encode_header",
    "encode_words",
    "expert_ids_from_counts",
    "flag_words",
    "new_accumulator",
    "plan_dispatch",
    "plan_on_device",
    "reference_device_pack",
    "reference_fused_combine",
    "slot_view",
    "torch_dtype",
]
