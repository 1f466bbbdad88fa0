"""DeepSeek-V2/V3 model configuration, read from a Hugging Face ``config.json``.

The keys keep their Hugging Face names so a field can be looked up in either place.
Everything that changes a tensor shape or a routing decision is *required*: a real
DeepSeek ``config.json`` always carries it, and guessing a default for, say,
``topk_method`` would silently route differently from the checkpoint. Only keys with a
neutral meaning when absent are optional (``q_lora_rank`` absent means a plain
``q_proj``, ``rope_scaling`` absent means no YaRN, ...).

Validation happens in ``__post_init__``, so presets with overrides
(``dataclasses.replace``) are checked the same way as files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from afd_models.errors import ConfigError

ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
"""Supported ``architectures`` entries and their ``model_type``."""

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")

REQUIRED_KEYS: Mapping[str, str] = {
    "vocab_size": "embedding and lm_head rows",
    "hidden_size": "every projection",
    "intermediate_size": "the dense MLP layers",
    "moe_intermediate_size": "routed and shared experts",
    "num_hidden_layers": "the number of decoder layers",
    "num_attention_heads": "MLA heads",
    "n_routed_experts": "the router and the routed experts",
    "n_shared_experts": "the shared experts (0 for none)",
    "num_experts_per_tok": "top-k of the router",
    "first_k_dense_replace": "which layers are dense",
    "moe_layer_freq": "which layers are MoE",
    "n_group": "grouped top-k",
    "topk_group": "grouped top-k",
    "topk_method": "greedy / group_limited_greedy / noaux_tc",
    "scoring_func": "softmax / sigmoid router scores",
    "norm_topk_prob": "renormalising the top-k weights",
    "routed_scaling_factor": "scaling the routed branch",
    "kv_lora_rank": "the MLA latent",
    "qk_nope_head_dim": "MLA query/key head size",
    "qk_rope_head_dim": "the rotary part of MLA heads",
    "v_head_dim": "MLA value head size",
    "rope_theta": "rotary frequencies",
    "rms_norm_eps": "RMSNorm",
}
"""Keys a ``config.json`` must have, with what each one determines (used in errors)."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN rotary scaling (``rope_scaling`` with ``type``/``rope_type`` ``"yarn"``).

    Defaults are those of the DeepSeek reference implementation for absent keys.
    """

    factor: float
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise ConfigError(
                "rope_scaling.original_max_position_embeddings must be >= 1, got "
                f"{self.original_max_position_embeddings}"
            )

    @classmethod
    def from_hf(cls, raw: Any) -> RopeScaling | None:
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ConfigError(f"rope_scaling must be an object or null, got {raw!r}")
        kind = raw.get("type", raw.get("rope_type"))
        if kind != "yarn":
            raise ConfigError(
                f"rope_scaling type {kind!r} is not supported; DeepSeek-V2/V3 use 'yarn' "
                f"(or no rope_scaling at all)"
            )
        if "factor" not in raw:
            raise ConfigError("rope_scaling of type 'yarn' needs a 'factor'")
        known = {f.name for f in fields(cls)}
        values = {k: raw[k] for k in known if k in raw}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"rope_scaling.{key} must be a number, got {value!r}")
        values["original_max_position_embeddings"] = int(
            values.get("original_max_position_embeddings", 4096)
        )
        return cls(**values)

    def to_hf(self) -> dict[str, Any]:
        return {"type": "yarn", **asdict(self)}


@dataclass(frozen=True)
class DeepseekConfig:
    """Shapes, routing and rotary settings of a DeepSeek-V2/V3 model (HF key names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rms_norm_eps: float
    q_lora_rank: int | None = None
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    """DeepSeek checkpoints store the rotary dims as interleaved pairs (GPT-J style)."""
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; afd_models reads "
                f"{' or '.join(ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_layer_freq",
            "n_group",
            "topk_group",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        ):
            self._positive_int(name)
        for name in ("n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if self.q_lora_rank is not None:
            self._positive_int("q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"qk_rope_head_dim must be even (rotary works on pairs), got "
                f"{self.qk_rope_head_dim}"
            )
        for name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_routing()

    def _positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")

    def _check_routing(self) -> None:
        experts, topk = self.n_routed_experts, self.num_experts_per_tok
        if self.topk_method not in TOPK_METHODS:
            raise ConfigError(
                f"topk_method {self.topk_method!r} is not supported; use one of {TOPK_METHODS}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(
                f"scoring_func {self.scoring_func!r} is not supported; use one of {SCORING_FUNCS}"
            )
        if topk > experts:
            raise ConfigError(f"num_experts_per_tok ({topk}) exceeds n_routed_experts ({experts})")
        if not self.grouped_topk:
            return
        if experts % self.n_group:
            raise ConfigError(
                f"n_routed_experts ({experts}) must be a multiple of n_group ({self.n_group}) "
                f"for topk_method {self.topk_method!r}"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        per_group = experts // self.n_group
        if topk > self.topk_group * per_group:
            raise ConfigError(
                f"num_experts_per_tok ({topk}) exceeds the {self.topk_group} x {per_group} "
                f"experts that topk_group={self.topk_group} groups of {per_group} can offer"
            )
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ConfigError(
                f"noaux_tc scores a group by its two best experts, so groups need at least 2 "
                f"experts; n_routed_experts={experts} in n_group={self.n_group} gives {per_group}"
            )

    # ---- derived ------------------------------------------------------------------

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """Intermediate size of the shared-expert MLP (the shared experts fused into one)."""
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def grouped_topk(self) -> bool:
        """Whether routing first picks ``topk_group`` of ``n_group`` expert groups."""
        return self.topk_method != "greedy"

    @property
    def uses_correction_bias(self) -> bool:
        """``noaux_tc`` adds ``e_score_correction_bias`` to the scores used for selection."""
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer: int) -> bool:
        """The reference rule: MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``."""
        if not 0 <= layer < self.num_hidden_layers:
            raise ConfigError(f"layer {layer} is outside [0, {self.num_hidden_layers})")
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def softmax_scale(self) -> float:
        """Attention scale: ``qk_head_dim ** -0.5``, times ``mscale**2`` under YaRN."""
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        rope = self.rope_scaling
        if rope is not None and rope.mscale_all_dim:
            m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
            scale *= m * m
        return scale

    # ---- Hugging Face config.json -------------------------------------------------

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> DeepseekConfig:
        """Read a parsed ``config.json``; unknown architectures and missing keys raise."""
        architectures = raw.get("architectures")
        if not isinstance(architectures, list) or not architectures:
            raise ConfigError(
                "config.json has no 'architectures' list; afd_models reads "
                f"{' or '.join(ARCHITECTURES)} configs"
            )
        supported = [a for a in architectures if a in ARCHITECTURES]
        if not supported:
            raise ConfigError(
                f"architectures {architectures} are not supported; afd_models reads "
                f"{' or '.join(ARCHITECTURES)}"
            )
        missing = [key for key in REQUIRED_KEYS if key not in raw or raw[key] is None]
        if missing:
            detail = "; ".join(f"{key} ({REQUIRED_KEYS[key]})" for key in missing)
            raise ConfigError(
                f"{supported[0]} config.json is missing required fields: {detail}. A "
                f"DeepSeek config.json from the Hugging Face hub has all of them."
            )
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads", heads)
        if kv_heads != heads:
            raise ConfigError(
                f"num_key_value_heads ({kv_heads}) differs from num_attention_heads ({heads}); "
                f"MLA models have one key/value head per attention head"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported; DeepSeek MLPs use 'silu'")
        values: dict[str, Any] = {key: raw[key] for key in REQUIRED_KEYS}
        for key in (
            "q_lora_rank",
            "rope_interleave",
            "max_position_embeddings",
            "tie_word_embeddings",
        ):
            if key in raw:
                values[key] = raw[key]
        for key in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            if isinstance(values[key], int) and not isinstance(values[key], bool):
                values[key] = float(values[key])
        return cls(
            architecture=supported[0],
            rope_scaling=RopeScaling.from_hf(raw.get("rope_scaling")),
            **values,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> DeepseekConfig:
        """Read ``config.json``, or ``<dir>/config.json`` when ``path`` is a directory."""
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {file}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file} must hold a JSON object")
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` object that :meth:`from_hf_dict` reads back to ``self``."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "num_key_value_heads": self.num_attention_heads,
        }
        for f in fields(self):
            if f.name in ("architecture", "rope_scaling"):
                continue
            out[f.name] = getattr(self, f.name)
        out["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_hf()
        return out

    def save_json(self, path: str | Path) -> Path:
        """Write ``config.json`` (into ``path`` when it is a directory); returns the file."""
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        file.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        return file


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention-temperature correction ``0.1 * mscale * ln(scale) + 1``."""
    if scale <= 1:
        return 1.0
    value: float = 0.1 * mscale * math.log(scale) + 1.0
    return value
