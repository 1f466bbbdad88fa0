"""The plugin's configuration: ``--additional-config '{"afd": {...}}'``.

The keys are those of the public AFD plugin, so its users can switch: ``role``,
``connector``, ``num_attention_ranks``, ``num_ffn_ranks``, ``compute_gate_on_attention``,
``host``, ``port``, ``async`` (``async_dp``) and ``connector_extra_config``, with the same
aliases (``afd_role``, ``afd_connector``, ``afd_host``, ``afd_port``). The connectors are
afd's own (:data:`CONNECTORS`); each one's ``connector_extra_config`` is a closed schema
(:mod:`afd_vllm.extra`): an unknown key is refused, naming the keys that exist.

The plugin does nothing unless ``additional_config`` has an ``"afd"`` entry
(:func:`parse_afd_config` returns None). Every error is an :class:`AFDConfigError` whose
message names the key and says what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from afd_vllm.extra import AFDConfigError, ExtraConfig, coerce_bool, coerce_int, parse_extra

CONNECTORS = ("GpuAsyncAFDConnector", "CAMAsyncAFDConnector", "HostAsyncAFDConnector")
"""afd's connectors: NVSHMEM between GPUs, Ascend CAM's operators, and host shared memory
(CPU, one machine)."""
ROLES = ("attention", "ffn")
ALIASES = {
    "afd_role": "role",
    "afd_connector": "connector",
    "afd_host": "host",
    "afd_port": "port",
    "async": "async_dp",
}
"""The public plugin's alternative spellings."""


@dataclass(frozen=True)
class AFDConfig:
    """One process's AFD settings, validated at construction."""

    role: str = "attention"
    """``attention`` (the vLLM engine with the KV cache) or ``ffn`` (the routed experts)."""
    connector: str = "GpuAsyncAFDConnector"
    num_attention_ranks: int = 1
    """Attention workers in the deployment (data parallel x tensor parallel)."""
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = True
    """The router runs on the attention side; afd's FFN ranks never route, so it must be
    true (accepted for compatibility with the public plugin's key)."""
    async_dp: bool = True
    """Replicas advance without DP coordination; afd is asynchronous, so it must be true."""
    host: str = "127.0.0.1"
    """Where the rendezvous store listens (loopback unless the deployment spans hosts)."""
    port: int = 1239
    extra: ExtraConfig = field(default_factory=lambda: parse_extra("GpuAsyncAFDConnector", {}))
    """The connector's ``connector_extra_config``, parsed by its schema."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise AFDConfigError(f"afd.role must be one of {list(ROLES)}, got {self.role!r}")
        if self.connector not in CONNECTORS:
            raise AFDConfigError(
                f"afd.connector must be one of {list(CONNECTORS)}, got {self.connector!r}"
            )
        for name in ("num_attention_ranks", "num_ffn_ranks"):
            if getattr(self, name) < 1:
                raise AFDConfigError(f"afd.{name} must be >= 1, got {getattr(self, name)}")
        if not self.compute_gate_on_attention:
            raise AFDConfigError(
                "afd.compute_gate_on_attention must be true: afd routes on the attention side "
                "and its FFN ranks never run the router"
            )
        if not self.async_dp:
            raise AFDConfigError(
                "afd.async must be true: afd's replicas advance without DP coordination "
                "(for lockstep AFD use another connector)"
            )
        if not self.host:
            raise AFDConfigError("afd.host must be a host name or address, got ''")
        if not 1 <= self.port <= 65535:
            raise AFDConfigError(f"afd.port must be in 1..65535, got {self.port}")
        if self.extra.connector != self.connector:
            raise AFDConfigError(
                f"afd.connector_extra_config was parsed for {self.extra.connector}, not "
                f"{self.connector}"
            )
        replicas = self.extra.attn_ranks_per_dp
        if self.num_attention_ranks % replicas:
            raise AFDConfigError(
                f"afd.num_attention_ranks ({self.num_attention_ranks}) must be a multiple of "
                f"connector_extra_config.attn_ranks_per_dp ({replicas})"
            )

    @property
    def is_attention(self) -> bool:
        return self.role == "attention"


_SCALARS = {f.name for f in fields(AFDConfig)} - {"extra"}


def parse_afd_config(
    additional_config: Mapping[str, Any] | None, *, expected_role: str | None = None
) -> AFDConfig | None:
    """The ``"afd"`` entry of vLLM's ``additional_config`` as an :class:`AFDConfig`, or None
    when there is none (the plugin then stays out of the way)."""
    if not additional_config or "afd" not in additional_config:
        return None
    raw = additional_config["afd"]
    if not isinstance(raw, Mapping):
        raise AFDConfigError(
            f"additional_config['afd'] must be a JSON object, got {type(raw).__name__}"
        )
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = ALIASES.get(key, key)
        if name == "connector_extra_config":
            continue
        if name not in _SCALARS:
            keys = sorted(_SCALARS | {"connector_extra_config"})
            raise AFDConfigError(
                f"unknown key afd.{key}; the keys are {keys} (connector settings go in "
                f"connector_extra_config)"
            )
        if name in values:
            raise AFDConfigError(f"afd.{name} is given twice (as {name} and as an alias)")
        values[name] = _coerce(name, value)
    connector = values.get("connector", AFDConfig.connector)
    extra = raw.get("connector_extra_config", {})
    if not isinstance(extra, Mapping):
        raise AFDConfigError(
            f"afd.connector_extra_config must be a JSON object, got {type(extra).__name__}"
        )
    config = AFDConfig(**values, extra=parse_extra(str(connector), extra))
    if expected_role is not None and config.role != expected_role:
        raise AFDConfigError(
            f"this process runs the {expected_role} role but afd.role is {config.role!r}"
        )
    return config


def _coerce(name: str, value: Any) -> Any:
    kind = {f.name: f.type for f in fields(AFDConfig)}[name]
    if kind == "bool":
        return coerce_bool(f"afd.{name}", value)
    if kind == "int":
        return coerce_int(f"afd.{name}", value)
    if not isinstance(value, str):
        raise AFDConfigError(f"afd.{name} must be a string, got {value!r}")
    return value.strip()
