"""The attention role's model inside vLLM: DeepSeek-V2/V3 with vLLM's own attention (MLA
over the paged KV cache) and every MoE block replaced by dispatch/combine through afd.

:class:`AFDDeepseekV2ForCausalLM` (and its V3 twin) is vLLM's ``DeepseekV2ForCausalLM``
built with :class:`AFDRemoteMoE` in place of ``DeepseekV2MoE``: the router (afd_models'
:class:`~afd_models.router.Router`, the same routing the FFN side was verified against) and
the shared experts stay here; the routed experts live on the FFN ranks and no routed-expert
weight is read. vLLM picks these classes because :mod:`afd_vllm.vllm_compat` rewrites the
architecture of an attention-role engine (``hf_overrides``); they are registered with
vLLM's model registry by :func:`register_models`, lazily, by name.

Import this module only where vLLM is installed (it imports vLLM's DeepSeek model).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models import deepseek_v2
from vllm.model_executor.models.utils import extract_layer_index

from afd_models import DeepseekConfig
from afd_models.router import Router

ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "AFDDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "AFDDeepseekV3ForCausalLM",
}
"""Checkpoint architecture -> the attention role's architecture."""

_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def routing_config(hf_config: Any) -> DeepseekConfig:
    """afd_models' config for the router, from vLLM's ``hf_config``.

    Only the routing fields are meaningful: transformers 5 moved the rotary settings into
    ``rope_parameters``, which afd_models does not read, and the attention here is vLLM's,
    so the rotary fields are neutral placeholders.
    """
    raw = hf_config.to_dict()
    back = {afd: original for original, afd in ARCHITECTURES.items()}
    raw["architectures"] = [back.get(a, a) for a in raw.get("architectures") or []]
    raw["rope_theta"] = 10000.0
    raw["rope_scaling"] = None
    return DeepseekConfig.from_hf_dict(raw)


class _Gate(nn.Module):
    """The router's parameters under the checkpoint's names (``mlp.gate.weight``,
    ``mlp.gate.e_score_correction_bias``); loaded by vLLM's default weight loader."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if with_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )


class AFDRemoteMoE(nn.Module):
    """One MoE block whose routed experts run on the FFN ranks.

    ``forward`` routes, dispatches (``afd::moe_dispatch``, weights times the routed scale,
    as the FFN-side reduction expects), runs the shared experts while the FFN ranks work,
    and combines (``afd::moe_combine``). Its constructor takes ``DeepseekV2MoE``'s
    arguments, so vLLM's decoder layer builds it unchanged.
    """

    def __init__(
        self,
        config: Any,
        parallel_config: Any = None,
        quant_config: Any = None,
        reduce_results: bool = True,
        prefix: str = "",
        apply_routed_scale_to_output: bool = False,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise NotImplementedError("afd-vllm's attention role does not run quantized models")
        self.layer = extract_layer_index(prefix)
        self.routing = routing_config(config)
        self.routed_scale = float(getattr(config, "routed_scaling_factor", 1.0))
        self.gate = _Gate(
            config.hidden_size,
            config.n_routed_experts,
            getattr(config, "topk_method", None) == "noaux_tc",
        )
        self.shared_experts: nn.Module | None = None
        if config.n_shared_experts:
            self.shared_experts = deepseek_v2.DeepseekV2MLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                hidden_act=config.hidden_act,
                reduce_results=False,
                prefix=f"{prefix}.shared_experts",
            )

    def forward(
        self, hidden_states: torch.Tensor, already_sequence_parallel: bool = False
    ) -> torch.Tensor:
        router = Router(self.routing, self.gate.weight, self.gate.e_score_correction_bias)
        routing = router(hidden_states)
        weights = routing.topk_weights
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        ticket = torch.ops.afd.moe_dispatch(hidden_states, routing.topk_ids, weights, self.layer, 0)
        shared = None if self.shared_experts is None else self.shared_experts(hidden_states)
        routed: torch.Tensor = torch.ops.afd.moe_combine(ticket, hidden_states)
        return routed if shared is None else routed + shared


@contextlib.contextmanager
def _remote_moe() -> Iterator[None]:
    """vLLM's decoder layer builds ``deepseek_v2.DeepseekV2MoE`` by its module-global name;
    rebind it to :class:`AFDRemoteMoE` for the duration of one model construction."""
    original = deepseek_v2.DeepseekV2MoE
    deepseek_v2.DeepseekV2MoE = AFDRemoteMoE
    try:
        yield
    finally:
        deepseek_v2.DeepseekV2MoE = original


class AFDDeepseekV2ForCausalLM(deepseek_v2.DeepseekV2ForCausalLM):  # type: ignore[misc]
    """vLLM's DeepSeek-V2 with :class:`AFDRemoteMoE` blocks (see the module docstring)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        with _remote_moe():
            super().__init__(vllm_config=vllm_config, prefix=prefix)

    def set_moe_parameters(self) -> None:
        """No local experts: vLLM's expert bookkeeping (EPLB, expert maps) sees none."""
        self.num_expert_groups = getattr(self.config, "n_group", 1)
        self.moe_layers: list[nn.Module] = []
        self.moe_mlp_layers: list[nn.Module] = []
        self.num_moe_layers = 0
        self.num_logical_experts = 0
        self.num_physical_experts = 0
        self.num_local_physical_experts = 0
        self.num_routed_experts = 0
        self.num_shared_experts = 0
        self.num_redundant_experts = 0

    def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
        return []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Everything but the routed experts, which the FFN ranks hold."""
        kept = ((name, w) for name, w in weights if not _ROUTED_EXPERT.search(name))
        loaded: set[str] = super().load_weights(kept)
        return loaded


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM):
    """The V3 twin (vLLM's ``DeepseekV3ForCausalLM`` is the V2 class too)."""


def register_models() -> None:
    """Register the AFD architectures with vLLM's model registry (by name: nothing is
    imported until vLLM builds one)."""
    from vllm import ModelRegistry

    for afd_name in ARCHITECTURES.values():
        if afd_name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(afd_name, f"afd_vllm.model:{afd_name}")
