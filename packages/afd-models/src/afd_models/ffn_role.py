"""The FFN role: one rank's routed experts for every MoE layer, serving work items.

A work item (one attention replica x one layer x one stage) arrives with a group list
per part; the executor never routes. Each part's rows, grouped by local expert
(``part.grouped()``: as they came in the ``per_choice`` wire format, expanded from one
row per token in ``per_rank``), go through the expert backend (expert id per row from the
group list, unit weight); ``part.finish`` turns the outputs into the reply: unchanged, for
the attention side to weight when it combines, or with ``combine_reduce="ffn"`` weighted
and summed per token here. With ``shared_placement="ffn"`` (seed 000) this rank
also holds the shared experts and computes the shared branch of the tokens assigned to
it, scaled by the same float16 rule as everywhere else (:mod:`afd_models.scaling`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from afd_models._common import resolve
from afd_models.backends import ExpertBackend, get_expert_backend
from afd_models.config import DeepseekConfig
from afd_models.errors import ConfigError
from afd_models.experts import ExpertStack, ExpertWeights, GroupedRows
from afd_models.graphed_experts import GraphedExperts
from afd_models.mlp import GatedMLP
from afd_models.params import ModelParams, shared_placement_of
from afd_models.scaling import BranchScales
from afd_models.weights import WeightSource
from afd_protocol import (
    Compute,
    Connection,
    EndpointOptions,
    FFNEndpoint,
    ServeStats,
    SharedPlacement,
    WorkItem,
    freeze_heap,
    serve,
)

ComputeWrapper = Callable[[Compute], Compute]
"""Wraps an FFN rank's ``compute(item) -> (routed_out, shared_out)`` (timing, moving items
between devices): takes a :data:`afd_protocol.Compute`, returns one with the same
contract."""


class FFNRoleExecutor:
    """Routed experts of one FFN rank (see the module docstring).

    ``weights`` defaults to ``RandomWeights(seed=0)``.
    """

    def __init__(
        self,
        config: DeepseekConfig,
        local_experts: Sequence[int],
        weights: WeightSource | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str | ExpertBackend = "reference",
        shared_placement: SharedPlacement | str = SharedPlacement.ATTENTION,
        graph_buckets: Sequence[int] | None = None,
    ) -> None:
        """``graph_buckets``: run the routed experts as CUDA-graph replays, one graph per
        bucket of rows (:class:`~afd_models.graphed_experts.GraphedExperts`; needs
        ``backend="triton"``, whose kernels the graphs hold; eager where not on CUDA)."""
        source, self.dtype, self.device = resolve(weights, dtype, device)
        self.config = config
        self.local_experts = tuple(local_experts)
        bad = [e for e in self.local_experts if not 0 <= e < config.n_routed_experts]
        if bad or not self.local_experts:
            raise ConfigError(
                f"local_experts must be a non-empty list of ids in [0, "
                f"{config.n_routed_experts}); got {list(self.local_experts)}"
            )
        self.shared_placement = shared_placement_of(shared_placement)
        self.backend = get_expert_backend(backend)
        self.scales = BranchScales.for_dtype(config.routed_scaling_factor, dtype)
        params = ModelParams(config)
        self.stack = ExpertStack.load(config, self.local_experts, source, dtype, self.device)
        """Every MoE layer's routed experts in one allocation (layer-select kernels)."""
        self.experts: dict[int, ExpertWeights] = {
            layer: self.stack.layer(layer) for layer in config.moe_layers
        }
        self.graphed: GraphedExperts | None = None
        if graph_buckets is not None:
            if self.backend.name != "triton":
                raise ConfigError(
                    f"graph_buckets runs the triton backend's kernels, but the backend is "
                    f"{self.backend.name!r}: pass backend='triton' (or no graph_buckets)"
                )
            self.graphed = GraphedExperts(self.stack, graph_buckets)
        self.shared: dict[int, GatedMLP] = {}
        for layer in config.moe_layers:
            shared = params.shared_experts(layer)
            if self.shared_placement is SharedPlacement.FFN and shared:
                self.shared[layer] = GatedMLP.load(shared, source, dtype, self.device)

    def compute(self, item: WorkItem) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(routed_out, shared_out)`` for ``item``, parts concatenated in order."""
        experts = self.experts.get(item.layer)
        if experts is None:
            raise ConfigError(
                f"work item for layer {item.layer}, which is not an MoE layer of this model "
                f"(MoE layers: {list(self.config.moe_layers)}); both roles must use one config"
            )
        routed: list[torch.Tensor] = []
        shared: list[torch.Tensor] = []
        for part in item.parts:
            if part.routed_rows.dtype != self.dtype:
                raise ConfigError(
                    f"the window carries {part.routed_rows.dtype} but this executor runs in "
                    f"{self.dtype}"
                )
            # Rows by local expert whatever the wire format (per_rank token rows are
            # expanded here), and the reply it wants (reduced with the weights, or not).
            rows, group_list = part.grouped()
            work = GroupedRows(rows.to(self.device), group_list)
            if self.graphed is not None:
                routed.append(part.finish(self.graphed(item.layer, work)))
            else:
                routed.append(part.finish(self.backend(work, experts)))
            if part.shared_rows.shape[0]:
                shared.append(self._shared(item.layer, part.shared_rows.to(self.device)))
        routed_out = torch.cat(routed) if routed else self._empty()
        return routed_out, (torch.cat(shared) if shared else None)

    def device_expert_step(
        self,
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The routed experts of every MoE layer as one step a CUDA graph can hold: ``step(rows
        [P, H], counts int64 [E_local], layer int32 [1]) -> [P, H]``, everything on
        :attr:`device` in :attr:`dtype`, rows grouped by local expert (``counts`` each, in
        order; rows past their sum are never read), ``layer`` the *model* layer index --
        mapped to its place in the stacked weights on the device, so nothing reaches the
        host. The ``triton`` backend's kernels (gate/up GEMM, SwiGLU, down GEMM over the
        layer-select weight stack), as :meth:`compute` runs them; what a device serve loop
        (``afd_transport_nvshmem.graphed_ffn``) captures around its intake and reply. Needs
        ``backend="triton"`` and the shared experts on the attention side."""
        if self.backend.name != "triton":
            raise ConfigError(
                f"a device expert step runs the triton backend's kernels, but the backend is "
                f"{self.backend.name!r}: build the executor with backend='triton'"
            )
        if self.shared_placement is SharedPlacement.FFN:
            raise ConfigError(
                "a device expert step computes routed experts only; with shared_placement='ffn' "
                "use compute() (or place the shared experts on the attention side)"
            )
        from afd_models import triton_grouped_gemm

        positions = torch.zeros(self.config.num_hidden_layers, dtype=torch.int32)
        for layer in self.config.moe_layers:
            positions[layer] = self.stack.position(layer)
        on_device = positions.to(self.device)
        stack = self.stack

        def step(rows: torch.Tensor, counts: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
            where = on_device.index_select(0, layer.long())
            return triton_grouped_gemm.expert_step(rows, stack.gate_up, stack.down, counts, where)

        return step

    def _shared(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        if self.shared_placement is not SharedPlacement.FFN:
            raise ConfigError(
                "received shared-expert rows, but this FFN executor was built with "
                "shared_placement='attention'; build both roles from the same setting"
            )
        mlp = self.shared.get(layer)
        if mlp is None:  # n_shared_experts == 0: the shared branch is zero
            return torch.zeros_like(rows)
        out = mlp(rows)
        return out if self.scales.shared == 1.0 else out * self.scales.shared

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)

    def serve(
        self,
        endpoint: FFNEndpoint,
        *,
        timeout: float | None = None,
        keep_waiting: bool = False,
        compute: Compute | None = None,
        stats: ServeStats | None = None,
    ) -> ServeStats:
        """Serve work items with :func:`afd_protocol.serve` until every attention rank shut down.

        ``timeout`` bounds each wait for the next item (``PeerTimeout`` when exceeded,
        unless ``keep_waiting``: then idle stretches are waited out, and only a failed peer
        ends the loop); ``None`` uses the endpoint's own timeout. ``compute`` replaces
        :meth:`compute` (a caller's wrapper of it: timing, moving items between devices).
        ``stats`` is filled item by item (see :func:`afd_protocol.serve`) and returned.
        """
        self._check_endpoint(endpoint)
        return serve(
            endpoint,
            compute or self.compute,
            timeout=timeout,
            while_idle="wait" if keep_waiting else "raise",
            stats=stats,
        )

    def serve_rank(
        self,
        connection: Connection,
        options: EndpointOptions | None = None,
        *,
        compute_wrappers: Sequence[ComputeWrapper] = (),
        stats: ServeStats | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> ServeStats:
        """The FFN rank program: serve this rank over ``connection`` until every attention
        rank shut down; what ``afd run``'s FFN ranks and ``afd-vllm ffn`` both run once
        they built the executor and connected.

        Opens the rank's endpoint with ``options`` (the connection's defaults when None),
        wraps :meth:`compute` with ``compute_wrappers`` in order (the first wraps
        :meth:`compute` itself, each next one the result), calls ``on_ready`` (the endpoint
        is open, nothing served yet), freezes the start-up heap
        (:func:`afd_protocol.freeze_heap`: no full garbage collection of it while serving)
        and serves with ``keep_waiting`` (idle stretches are waited out; a failed peer still
        ends the loop with ``PeerAborted``). The work items arrive as the endpoint gives
        them (rows ``[rows, hidden]`` in the wire's dtype on ``connection.device``): a
        wrapper that stages them onto :attr:`device` and the outputs back is the caller's
        when the two differ.

        Returns ``stats`` (a new :class:`afd_protocol.ServeStats` when None), filled item by
        item: a caller that keeps it reads the service live, e.g. the items per replica
        (:meth:`afd_protocol.ServeStats.per_replica`). Leaves ``connection`` open, to the
        caller to abort or close.
        """
        compute: Compute = self.compute
        for wrap in compute_wrappers:
            compute = wrap(compute)
        endpoint = connection.ffn_endpoint(options)
        if on_ready is not None:
            on_ready()
        freeze_heap()
        return self.serve(endpoint, keep_waiting=True, compute=compute, stats=stats)

    def _check_endpoint(self, endpoint: FFNEndpoint) -> None:
        """Raise :class:`ConfigError` unless ``endpoint`` serves this executor's experts with
        its shared-expert placement."""
        if tuple(endpoint.local_experts) != self.local_experts:
            raise ConfigError(
                f"this executor holds experts {list(self.local_experts)} but FFN rank "
                f"{endpoint.rank} owns {list(endpoint.local_experts)}"
            )
        if endpoint.shared_placement is not self.shared_placement:
            raise ConfigError(
                f"the endpoint's shared_placement is {endpoint.shared_placement.value!r} but "
                f"this executor was built for {self.shared_placement.value!r}; build both from "
                f"the same setting"
            )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this rank holds, by checkpoint name."""
        out: dict[str, torch.Tensor] = {}
        for layer, experts in self.experts.items():
            out.update(experts.tensors(self.config))
            if layer in self.shared:
                out.update(self.shared[layer].tensors())
        return out
