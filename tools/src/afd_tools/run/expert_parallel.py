"""Colocated DP+EP, the deployment AFD is measured against: every rank holds attention and
1/G of the routed experts, and at every MoE layer the G ranks exchange tokens with
collectives.

The exchange is all_gather + reduce_scatter (what vLLM's ``allgather_reducescatter``
all-to-all backend does): every rank gathers every rank's tokens, routing ids and weights,
computes the rows routed to its own experts, weights and sums them per token in float32,
and a reduce_scatter returns to each rank the sum over all ranks for its own tokens. On
two H200s this was the faster of the two exchanges vLLM offers (0.09 / 0.20 / 0.35 /
0.62 ms per layer at 1K / 4K / 8K / 16K tokens per rank, against 0.37 / 0.57 / 0.87 /
1.40 ms for an all_to_all with host-read counts; ``docs/design-notes.md``).

Collectives need equal sizes, so every rank pads its tokens to the step's largest batch,
which the ranks agree on once per step (:meth:`ExpertParallelEndpoint.begin_step`), not per
layer. Every rank must run every layer of every step: a rank without work joins with a
dummy batch, as data-parallel engines do.

It is written as an :class:`~afd_protocol.AttentionEndpoint` so that the same
:class:`afd_models.AttentionRoleModel` runs it (shared experts local, as colocated serving
computes them): ``dispatch`` does the whole exchange and the local experts, ``combine``
hands the result back.

Known cost the baseline pays that a fused kernel would not: the number of rows routed to
this rank's experts is read on the host once per layer (to size the grouped GEMM's
input), one device synchronisation per layer.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from afd_models import DeepseekConfig, RandomWeights
from afd_models.backends import ExpertBackend, get_expert_backend
from afd_models.experts import ExpertWeights, GroupedRows
from afd_protocol import (
    CapacityError,
    ConnectorShutdown,
    EndpointOptions,
    InvalidArgument,
    Role,
    SharedPlacement,
    SlotLayout,
    WindowLayout,
    check_dispatch_inputs,
)
from afd_tools.run.peerless import PeerlessConnection

STORE_FILE = "expert-parallel-store"
"""The torch.distributed file store, inside the launcher's private rendezvous directory
(removed with it)."""


def local_expert_table(
    num_experts: int, local_experts: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """int64 ``[num_experts + 1]``: the local id of each global expert, -1 where another rank
    holds it; the extra last entry (-1) is where padding rows point."""
    table = torch.full((num_experts + 1,), -1, dtype=torch.long)
    for local, expert in enumerate(local_experts):
        table[expert] = local
    return table.to(device)


def local_partials(
    rows: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    table: torch.Tensor,
    experts: ExpertWeights,
    backend: ExpertBackend,
) -> torch.Tensor:
    """float32 ``[M, H]``: per token, ``sum_j w_j * expert_j(row)`` over the top-k choices
    whose expert is local (``table[id] >= 0``); zero for the others."""
    k = topk_ids.shape[1]
    local = table.index_select(0, topk_ids.reshape(-1).long())
    chosen = (local >= 0).nonzero().squeeze(1)  # the one host read per layer
    keys = local.index_select(0, chosen)
    order = torch.sort(keys, stable=True).indices
    flat = chosen.index_select(0, order)
    token = torch.div(flat, k, rounding_mode="floor")
    group_list = torch.bincount(keys, minlength=experts.num_local_experts)
    outputs = backend(GroupedRows(rows.index_select(0, token), group_list), experts)
    weights = topk_weights.reshape(-1).index_select(0, flat).float()
    acc = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    acc.index_add_(0, token, outputs.float().mul_(weights[:, None]))
    return acc


@dataclass(frozen=True)
class ExpertParallelHandle:
    """A finished layer: the exchange happened inside ``dispatch``."""

    layer: int
    stage: int
    output: torch.Tensor
    ffn_ranks: tuple[int, ...] = ()


def _collective(
    current: str, older: str, output: torch.Tensor, tensor: torch.Tensor, group: Any
) -> None:
    """Call ``torch.distributed.<current>`` (torch >= 2.13), else ``<older>`` (torch 2.11,
    where the GPU host is; deprecated later)."""
    call = getattr(dist, current, None)
    if call is not None:
        call(output, tensor, group=group)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(dist, older)(output, tensor, group=group)


class ExpertParallelEndpoint:
    """One colocated rank's MoE exchange (see the module docstring)."""

    def __init__(
        self,
        layout: SlotLayout,
        rank: int,
        experts: dict[int, ExpertWeights],
        backend: ExpertBackend,
        device: torch.device,
        options: EndpointOptions,
        *,
        group: Any = None,
        host_staging: bool = False,
    ) -> None:
        self.layout = layout
        self._rank = rank
        self.world = layout.topology.num_ffn_ranks
        self.experts = experts
        self.backend = backend
        self.device = device
        self.options = options
        self.group = group
        self.host_staging = host_staging
        """Collectives on host copies (gloo with tensors on a GPU that several ranks share,
        where NCCL refuses to run)."""
        local = layout.topology.local_experts(rank)
        self.table = local_expert_table(layout.topology.num_experts, local, device)
        self.rows = 0
        """Rows every rank sends this step (see :meth:`begin_step`)."""
        self._in_flight = 0
        self._shut = False
        self.exchange_s = 0.0
        """Seconds spent in the collectives, waiting for the slowest rank included (on a
        GPU, NCCL calls return once queued, so there this counts only the host's part)."""

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.layout.dtype)  # type: ignore[no-any-return]

    @property
    def shared_placement(self) -> SharedPlacement:
        return SharedPlacement.ATTENTION

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def begin_step(self, rows: int) -> None:
        """Every rank's batch this step has at most ``rows`` tokens: each pads to it."""
        if not 1 <= rows <= self.layout.token_cap:
            raise CapacityError(
                f"a step of {rows} tokens per rank; the exchange holds 1..{self.layout.token_cap} "
                f"(max_num_batched_tokens)"
            )
        self.rows = rows

    def dispatch(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        stage: int = 0,
    ) -> ExpertParallelHandle:
        if self._shut:
            raise ConnectorShutdown(f"colocated rank {self._rank} announced shutdown")
        check_dispatch_inputs(
            self.layout,
            self.options,
            self.device,
            "exchange",
            layer_idx,
            stage,
            hidden_states,
            topk_ids,
            topk_weights,
        )
        experts = self.experts.get(layer_idx)
        if experts is None:
            raise InvalidArgument(f"layer {layer_idx} is not an MoE layer of this model")
        n = hidden_states.shape[0]
        if n > self.rows:
            raise CapacityError(
                f"{n} tokens at layer {layer_idx}, but this step was agreed at {self.rows} "
                f"per rank; call begin_step with the step's largest batch"
            )
        pad = self.rows - n
        x = hidden_states
        ids = topk_ids.long()
        weights = topk_weights.float()
        if pad:
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
            sentinel = self.layout.topology.num_experts  # -> table's last entry, -1
            ids = torch.cat((ids, ids.new_full((pad, ids.shape[1]), sentinel)))
            weights = torch.cat((weights, weights.new_zeros(pad, weights.shape[1])))
        rows, all_ids, all_weights = (self._all_gather(t) for t in (x, ids, weights))
        acc = local_partials(rows, all_ids, all_weights, self.table, experts, self.backend)
        out = self._reduce_scatter(acc.to(x.dtype))
        self._in_flight += 1
        return ExpertParallelHandle(layer_idx, stage, out[:n])

    def combine(self, handle: Any, timeout: float | None = None) -> torch.Tensor:
        if not isinstance(handle, ExpertParallelHandle):
            raise InvalidArgument("combine got a handle this endpoint did not make")
        self._in_flight -= 1
        return handle.output

    def _on_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu() if self.host_staging else tensor

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        local = self._on_wire(tensor.contiguous())
        out = local.new_empty(self.world * local.shape[0], *local.shape[1:])
        start = time.perf_counter()
        _collective("all_gather_single", "all_gather_into_tensor", out, local, self.group)
        self.exchange_s += time.perf_counter() - start
        return out.to(self.device)

    def _reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        local = self._on_wire(tensor.contiguous())
        out = local.new_empty(local.shape[0] // self.world, *local.shape[1:])
        start = time.perf_counter()
        _collective("reduce_scatter_single", "reduce_scatter_tensor", out, local, self.group)
        self.exchange_s += time.perf_counter() - start
        return out.to(self.device)

    def announce_shutdown(self) -> None:
        self._shut = True

    def abort(self) -> None:
        """Nothing to tell: a failed rank's peers end in the launcher's clean-up or the
        process group's timeout."""

    def close(self) -> None:
        self._shut = True


class ExpertParallelConnection(PeerlessConnection):
    """One colocated rank's process group, shaped like an afd
    :class:`~afd_protocol.Connection` so the launcher can open it; its
    :meth:`attention_endpoint` loads this rank's experts and makes the exchange."""

    NO_FFN_ENDPOINT = "colocated ranks have no FFN role: every rank is both"

    def __init__(
        self,
        window: WindowLayout,
        rank: int,
        store_path: Path,
        connect_timeout: float,
        *,
        config: DeepseekConfig,
        seed: int,
        backend: str,
        device: torch.device,
        exchange: str,
    ) -> None:
        super().__init__(window, rank, device)
        self.config = config
        self.seed = seed
        self.backend = backend
        self.exchange = exchange
        world = window.slot.topology.num_ffn_ranks
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.FileStore(str(store_path), world)  # type: ignore[attr-defined]
        dist.init_process_group(
            exchange,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=connect_timeout),
        )
        self._open = True

    def attention_endpoint(self, options: EndpointOptions | None = None) -> ExpertParallelEndpoint:
        dtype = getattr(torch, self._layout.dtype)
        local = self._layout.topology.local_experts(self._rank)
        weights = RandomWeights(self.seed, device=self._device)
        experts = {
            layer: ExpertWeights.load(self.config, layer, local, weights, dtype, self._device)
            for layer in self.config.moe_layers
        }
        return ExpertParallelEndpoint(
            self._layout,
            self._rank,
            experts,
            get_expert_backend(self.backend),
            self._device,
            options or EndpointOptions(),
            host_staging=self.exchange == "gloo" and self._device.type != "cpu",
        )

    def abort(self) -> None:
        """Collectives have no abort word; the launcher stops the other ranks."""

    def close(self) -> None:
        """Leave the process group (once)."""
        if self._open:
            self._open = False
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def expert_parallel_connection(
    window: WindowLayout,
    role: Role,
    rank: int,
    rendezvous: str,
    connect_timeout: float,
    *,
    config: DeepseekConfig,
    seed: int,
    backend: str,
    device_kind: str,
    exchange: str,
) -> ExpertParallelConnection:
    """A launcher transport factory (bind the keywords with ``functools.partial``): rank
    ``rank`` of the colocated group, on GPU ``rank % visible GPUs`` when ``device_kind`` is
    ``cuda``."""
    if role is not Role.ATTENTION:
        raise InvalidArgument("colocated ranks are launched as attention ranks")
    device = torch.device("cpu")
    if device_kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return ExpertParallelConnection(
        window,
        rank,
        Path(rendezvous) / STORE_FILE,
        connect_timeout,
        config=config,
        seed=seed,
        backend=backend,
        device=device,
        exchange=exchange,
    )
