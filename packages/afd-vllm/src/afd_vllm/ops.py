"""Dispatch and combine as registered custom operators, so vLLM's compiler keeps them.

``torch.compile`` cannot trace into an endpoint (it waits on flags, touches shared memory,
keeps Python state), so the attention model calls these two operators instead of the
endpoint. The compiler sees them as opaque nodes with known output shapes (their fake
implementations), and vLLM can split its graph there (list them in
``compilation_config.splitting_ops``: :data:`SPLITTING_OPS`), capturing CUDA graphs for the
pieces in between.

* ``afd::moe_dispatch(hidden, topk_ids, topk_weights, layer, stage) -> ticket`` dispatches
  through the endpoint bound to this process and returns a 0-dim int64 ticket;
* ``afd::moe_combine(ticket, hidden) -> out`` combines that dispatch (``hidden`` only gives
  the output's shape and dtype, and orders the call after the layer's input exists).

The ticket is a data dependency from dispatch to combine, so no compiler pass can reorder
them or drop the dispatch. Bind the endpoint with :func:`bind_endpoint` before the first
call; :func:`unbind_endpoint` at shutdown.
"""

from __future__ import annotations

import itertools
import threading

import torch

from afd_protocol import AttentionEndpoint, DispatchHandle, InvalidArgument

SPLITTING_OPS = ("afd::moe_dispatch", "afd::moe_combine")

_lock = threading.Lock()
_endpoint: AttentionEndpoint | None = None
_handles: dict[int, DispatchHandle] = {}
_tickets = itertools.count(1)


def bind_endpoint(endpoint: AttentionEndpoint) -> None:
    """Make ``endpoint`` the one the operators use in this process."""
    global _endpoint
    with _lock:
        if _endpoint is not None and _endpoint is not endpoint:
            raise InvalidArgument(
                "an afd endpoint is already bound in this process; unbind_endpoint() first"
            )
        _endpoint = endpoint


def unbind_endpoint() -> None:
    """Forget the bound endpoint and every dispatch not combined (idempotent)."""
    global _endpoint
    with _lock:
        _endpoint = None
        _handles.clear()


def _bound() -> AttentionEndpoint:
    if _endpoint is None:
        raise InvalidArgument(
            "afd::moe_dispatch called with no endpoint bound; the AFD model runner binds one "
            "at start-up (afd_vllm.ops.bind_endpoint)"
        )
    return _endpoint


@torch.library.custom_op("afd::moe_dispatch", mutates_args=())
def moe_dispatch(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    layer: int,
    stage: int,
) -> torch.Tensor:
    handle = _bound().dispatch(layer, hidden_states, topk_ids, topk_weights, stage)
    ticket = next(_tickets)
    _handles[ticket] = handle
    return torch.tensor(ticket, dtype=torch.int64)


@moe_dispatch.register_fake
def _(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    layer: int,
    stage: int,
) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("afd::moe_combine", mutates_args=())
def moe_combine(ticket: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    handle = _handles.pop(int(ticket.item()), None)
    if handle is None:
        raise InvalidArgument(
            f"afd::moe_combine: ticket {int(ticket.item())} names no dispatch in flight (combined "
            f"twice, or dispatched before the endpoint was rebound)"
        )
    out = _bound().combine(handle)
    return out.clone() if out.data_ptr() == hidden_states.data_ptr() else out


@moe_combine.register_fake
def _(ticket: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(hidden_states)


def dispatch_and_combine(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    layer: int,
    stage: int = 0,
) -> torch.Tensor:
    """One MoE layer's routed output through the operators (what the AFD model calls when
    nothing runs between dispatch and combine)."""
    ticket = torch.ops.afd.moe_dispatch(hidden_states, topk_ids, topk_weights, layer, stage)
    out: torch.Tensor = torch.ops.afd.moe_combine(ticket, hidden_states)
    return out
