"""Engine-agnostic DeepSeek-V2/V3 MoE model pieces for afd, in plain torch.

* :class:`DeepseekConfig` (from a Hugging Face ``config.json``) and :func:`preset`
  (``tiny``, ``v2-lite``, ``v3-mini``, ``v3-slice``).
* Weights: :class:`RandomWeights` (deterministic per parameter name),
  :class:`SafetensorsWeights`, :class:`RoundedWeights` (a lower-precision model's float32
  twin), :func:`save_checkpoint`, :class:`WeightSelection` (what
  each role materialises).
* Layers: :class:`RMSNorm`, :class:`RotaryEmbedding` (YaRN), :class:`MLAttention`,
  :class:`GatedMLP`, :class:`Router` (with its :class:`Selection` for select hooks),
  :class:`ExpertWeights`, :class:`MoELayer`.
* Expert backends by name: ``reference``, ``grouped_mm``, and
  :func:`register_expert_backend` for more.
* :class:`MonolithicModel` (the reference), :class:`AttentionRoleModel` and
  :class:`FFNRoleExecutor` (the role split over ``afd_protocol`` endpoints;
  :meth:`FFNRoleExecutor.serve_rank` is the one FFN rank program).
"""

from importlib.metadata import PackageNotFoundError, version

from afd_models.attention import MLAttention
from afd_models.attention_role import (
    AttentionRoleModel,
    AttentionRunStats,
    ExchangeObserver,
    ExchangeReturn,
)
from afd_models.backends import (
    ExpertBackend,
    GroupedMMBackend,
    ReferenceBackend,
    expert_backend_names,
    get_expert_backend,
    register_expert_backend,
    unregister_expert_backend,
)
from afd_models.batch import (
    KVCache,
    Prompt,
    PromptBatch,
    PromptChunk,
    Segment,
    Stage,
    stage_count,
)
from afd_models.config import DeepseekConfig, RopeScaling
from afd_models.errors import BackendUnavailable, ConfigError, DeviceError, WeightsError
from afd_models.experts import ExpertStack, ExpertWeights, GroupedRows
from afd_models.ffn_role import ComputeWrapper, FFNRoleExecutor
from afd_models.gemm_check import check_gemms_write_every_output
from afd_models.mlp import GatedMLP
from afd_models.moe import MoELayer, routed_experts
from afd_models.monolithic import MonolithicModel
from afd_models.norm import RMSNorm
from afd_models.output import PrefillOutput
from afd_models.params import (
    ModelParams,
    ParamKind,
    ParamSpec,
    WeightSelection,
    is_routed_expert,
)
from afd_models.presets import PRESET_NAMES, preset
from afd_models.rotary import RotaryEmbedding
from afd_models.router import LayerSelect, Router, Routing, Select, Selection
from afd_models.scaling import BranchScales
from afd_models.weights import (
    RandomWeights,
    RoundedWeights,
    SafetensorsWeights,
    WeightSource,
    materialize,
    save_checkpoint,
    save_safetensors,
)

try:
    __version__ = version("afd-models")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "PRESET_NAMES",
    "AttentionRoleModel",
    "AttentionRunStats",
    "BackendUnavailable",
    "BranchScales",
    "ComputeWrapper",
    "ConfigError",
    "DeepseekConfig",
    "DeviceError",
    "ExchangeObserver",
    "ExchangeReturn",
    "ExpertBackend",
    "ExpertStack",
    "ExpertWeights",
    "FFNRoleExecutor",
    "GatedMLP",
    "GroupedMMBackend",
    "GroupedRows",
    "KVCache",
    "LayerSelect",
    "MLAttention",
    "MoELayer",
    "ModelParams",
    "MonolithicModel",
    "ParamKind",
    "ParamSpec",
    "PrefillOutput",
    "Prompt",
    "PromptBatch",
    "PromptChunk",
    "RMSNorm",
    "RandomWeights",
    "ReferenceBackend",
    "RopeScaling",
    "RotaryEmbedding",
    "RoundedWeights",
    "Router",
    "Routing",
    "SafetensorsWeights",
    "Segment",
    "Select",
    "Selection",
    "Stage",
    "WeightSelection",
    "WeightSource",
    "WeightsError",
    "__version__",
    "check_gemms_write_every_output",
    "expert_backend_names",
    "get_expert_backend",
    "is_routed_expert",
    "materialize",
    "preset",
    "register_expert_backend",
    "routed_experts",
    "save_checkpoint",
    "save_safetensors",
    "stage_count",
    "unregister_expert_backend",
]
