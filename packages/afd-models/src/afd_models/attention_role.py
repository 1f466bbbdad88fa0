"""The attention role: the model minus its routed experts, talking to FFN ranks.

It holds the embeddings, attention, dense MLPs, routers, the lm head, and the shared
experts when they run on this side (``shared_placement="attention"``, seed 002: they
are computed locally between dispatch and combine, overlapping the remote routed work).
At each MoE layer it routes, dispatches the normed rows to the FFN ranks through an
:class:`~afd_protocol.AttentionEndpoint` with the top-k weights times the routed scale
(the weights stay here and are applied in the combine), and later combines. The routed
experts are never materialised in this process.

With ``num_stages > 1`` the batch is cut into token-level stages and run on the
schedule of :mod:`afd_models.schedule`: stage ``i+1``'s attention is issued while stage
``i`` is at the FFN. The window's ``ring_depth`` must be at least the number of stages.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_models._common import resolve
from afd_models.batch import KVCache, Prompt, PromptBatch
from afd_models.config import DeepseekConfig
from afd_models.errors import ConfigError
from afd_models.output import PrefillOutput
from afd_models.params import shared_placement_of
from afd_models.router import LayerSelect
from afd_models.schedule import run_prefill
from afd_models.trunk import Trunk
from afd_models.weights import WeightSource
from afd_protocol import AttentionEndpoint, DispatchHandle, SharedPlacement

ExchangeReturn = Callable[[torch.Tensor], None]
"""Called once the combine of an observed exchange returned, with what it returned: ``out
[t, H]`` (model dtype, on the model's device; the shared experts included when they run on
the FFN ranks). ``out`` may be a buffer a later layer reuses: copy what is kept."""
ExchangeObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], ExchangeReturn | None]
"""A forward's observer of the MoE exchange, called at every MoE layer as its rows are
dispatched (layers in order; with several stages, a layer's stages in order, each with its
rows of the batch): ``(layer, x, topk_ids, weights)`` with ``x [t, H]`` the rows (model
dtype), ``topk_ids`` int64 ``[t, k]`` the experts they go to and ``weights`` float32
``[t, k]`` the top-k weights times the routed scale, all on the model's device and fresh
(the observer may keep them; keeping ``x`` holds a ``[t, H]`` activation). It returns what
to call with the combine's output (:data:`ExchangeReturn`), or ``None``."""


@dataclass
class AttentionRunStats:
    """What the last forward did at the MoE layers, as the engine running the model sees
    it: counts and host time. (A per-layer time breakdown on the device's timeline is the
    caller's to measure, by wrapping the endpoint: ``afd run`` does.)"""

    dispatches: int = 0
    combine_wait_s: float = 0.0
    """Host seconds spent inside ``combine`` (waiting for the FFN ranks, then the weighted
    sum): how long this rank could not go on."""
    max_in_flight: int = 0
    stages: int = 0
    layers: list[int] = field(default_factory=list)


class AttentionRoleModel:
    """The attention side of the role split (see the module docstring).

    ``weights`` defaults to ``RandomWeights(seed=0)``.
    """

    def __init__(
        self,
        config: DeepseekConfig,
        weights: WeightSource | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shared_placement: SharedPlacement | str = SharedPlacement.ATTENTION,
    ) -> None:
        source, self.dtype, self.device = resolve(weights, dtype, device)
        self.config = config
        self.shared_placement = shared_placement_of(shared_placement)
        self.trunk = Trunk(
            config,
            source,
            dtype=dtype,
            device=self.device,
            with_shared=self.shared_placement is SharedPlacement.ATTENTION,
        )
        self.stats = AttentionRunStats()

    def forward(
        self,
        prompts: Sequence[Prompt],
        endpoint: AttentionEndpoint,
        *,
        num_stages: int = 1,
        min_stage_tokens: int = 0,
        compute_logits: bool = True,
        cache: KVCache | None = None,
        select: LayerSelect | None = None,
        observe: ExchangeObserver | None = None,
    ) -> PrefillOutput:
        """Prefill ``prompts`` with the routed experts served through ``endpoint``, in
        ``num_stages`` stages (fewer where the batch has under ``min_stage_tokens`` tokens
        per stage: :func:`afd_models.batch.stage_count`).

        Entries may be chunks of longer prompts (:class:`~afd_models.batch.PromptChunk`), with a
        ``cache`` the caller keeps between calls (chunked prefill: the earlier chunks'
        compressed MLA keys stay on this rank). ``select`` sees every MoE layer's routing
        (each stage's rows) and may replace its top-k
        (:data:`~afd_models.router.LayerSelect`): what it returns is what is dispatched.
        ``observe`` sees every MoE layer's exchange, what went out and what came back
        (:data:`ExchangeObserver`): what a check of the exchange against the experts needs."""
        if endpoint.dtype != self.dtype:
            raise ConfigError(
                f"the window carries {endpoint.dtype} but this model runs in {self.dtype}; "
                f"build the SlotLayout with the model's dtype"
            )
        if endpoint.shared_placement is not self.shared_placement:
            raise ConfigError(
                f"the endpoint's shared_placement is {endpoint.shared_placement.value!r} but "
                f"this AttentionRoleModel was built for {self.shared_placement.value!r}; build "
                f"both from the same setting"
            )
        batch = PromptBatch.from_prompts(prompts, self.device)
        self.stats = AttentionRunStats()
        remote = _RemoteMoE(self, endpoint, select, observe)
        with torch.inference_mode():
            out = run_prefill(
                self.trunk,
                batch,
                remote,
                num_stages=num_stages,
                min_stage_tokens=min_stage_tokens,
                compute_logits=compute_logits,
                cache=cache,
            )
        self.stats.stages = len(batch.stages(num_stages, min_stage_tokens))
        return out

    __call__ = forward

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this role holds, by checkpoint name (no routed expert among them)."""
        return self.trunk.tensors()


class _RemoteMoE:
    """MoE execution through an endpoint: ``begin`` dispatches, ``end`` combines."""

    def __init__(
        self,
        model: AttentionRoleModel,
        endpoint: AttentionEndpoint,
        select: LayerSelect | None = None,
        observe: ExchangeObserver | None = None,
    ) -> None:
        self.model = model
        self.endpoint = endpoint
        self.routed_scale = model.trunk.scales.routed
        self.select = select
        self.observe = observe

    def begin(self, layer: int, stage: int, x: torch.Tensor) -> Any:
        router = self.model.trunk.router(layer)
        if self.select is None:
            routing = router(x)
        else:
            routing = router(x, functools.partial(self.select, layer))
        weights = routing.topk_weights
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        pending = self.endpoint.dispatch(layer, x, routing.topk_ids, weights, stage=stage)
        stats = self.model.stats
        stats.dispatches += 1
        stats.layers.append(layer)
        stats.max_in_flight = max(stats.max_in_flight, self.endpoint.in_flight)
        # Shared experts (when they run here) overlap the FFN ranks' routed work.
        returned = (
            None if self.observe is None else self.observe(layer, x, routing.topk_ids, weights)
        )
        return pending, self.model.trunk.shared_experts(layer, x), returned

    def end(self, handle: Any) -> torch.Tensor:
        pending: DispatchHandle = handle[0]
        shared: torch.Tensor | None = handle[1]
        start = time.perf_counter()
        out = self.endpoint.combine(pending).to(self.model.device)
        self.model.stats.combine_wait_s += time.perf_counter() - start
        returned: ExchangeReturn | None = handle[2]
        if returned is not None:
            returned(out)
        return out if shared is None else out + shared
