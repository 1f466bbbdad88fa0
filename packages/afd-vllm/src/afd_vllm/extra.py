"""``connector_extra_config``: one closed schema per connector.

Every field is declared with its type, default and allowed range or values; a key that no
field declares is refused with the list of the keys that exist, and a value outside its
range names the range. The schemas:

* every connector: ``attn_ranks_per_dp``, ``recv_poll_timeout_ms``,
  ``async_moe_ubatching``, ``async_moe_num_ubatches``, ``async_moe_split``;
* ``GpuAsyncAFDConnector`` and ``HostAsyncAFDConnector`` (afd's windows): also
  ``ring_depth``, ``routed_cap_multiplier``, ``wire_format``, ``combine_reduce``;
* ``HostAsyncAFDConnector``: also ``rendezvous_dir`` (the shared-memory rendezvous);
* ``CAMAsyncAFDConnector``: also ``dynamicQuant`` (the public plugin's spelling).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


class AFDConfigError(ValueError):
    """The AFD configuration is invalid; the message names the key and what to change."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def coerce_bool(key: str, value: Any) -> bool:
    """bool, 0/1, or one of the strings 1/true/yes/on and 0/false/no/off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise AFDConfigError(f"{key} must be true or false, got {value!r}")


def coerce_int(key: str, value: Any) -> int:
    """A whole number (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise AFDConfigError(f"{key} must be a whole number, got {value!r}")
    return value


def coerce_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AFDConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def _spec(
    default: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[Any, ...] | None = None,
    doc: str = "",
) -> Any:
    return field(
        default=default, metadata={"low": low, "high": high, "choices": choices, "doc": doc}
    )


@dataclass(frozen=True)
class ExtraConfig:
    """The settings every afd connector takes."""

    connector: ClassVar[str] = ""
    attn_ranks_per_dp: int = _spec(1, low=1, high=64, doc="attention ranks of one DP replica")
    recv_poll_timeout_ms: int = _spec(
        30000, low=1, high=3_600_000, doc="ms a wait for replies or work may take"
    )
    connect_timeout_s: int = _spec(
        300, low=1, high=3600, doc="seconds to wait at start-up for every peer to join"
    )
    async_moe_ubatching: bool = _spec(
        False, doc="cut each batch into token-level stages whose attention and FFN overlap"
    )
    async_moe_num_ubatches: int = _spec(2, low=1, high=8, doc="stages when ubatching")
    async_moe_split: str = _spec(
        "token", choices=("token",), doc="how stages are cut (afd cuts by tokens)"
    )

    @property
    def num_stages(self) -> int:
        return self.async_moe_num_ubatches if self.async_moe_ubatching else 1

    @classmethod
    def describe(cls) -> dict[str, dict[str, Any]]:
        """Every key with its default, range and meaning (the README's table)."""
        return {f.name: {"default": f.default, **f.metadata} for f in fields(cls)}


@dataclass(frozen=True)
class WindowExtraConfig(ExtraConfig):
    """afd's window connectors (NVSHMEM, host shared memory)."""

    ring_depth: int = _spec(
        2, low=1, high=64, doc="dispatches in flight per replica (>= the stages)"
    )
    routed_cap_multiplier: float = _spec(
        2.0, low=1.0, high=1024.0, doc="receive capacity over an even split of the rows"
    )
    wire_format: str = _spec(
        "per_rank", choices=("per_rank", "per_choice"), doc="rows once per FFN rank or per expert"
    )
    combine_reduce: str = _spec(
        "ffn", choices=("ffn", "attention"), doc="who weights and sums the partials"
    )


@dataclass(frozen=True)
class GpuExtraConfig(WindowExtraConfig):
    connector: ClassVar[str] = "GpuAsyncAFDConnector"


@dataclass(frozen=True)
class HostExtraConfig(WindowExtraConfig):
    connector: ClassVar[str] = "HostAsyncAFDConnector"
    rendezvous_dir: str = _spec(
        "", doc="directory the roles meet in (default: one per port under the temp dir)"
    )


@dataclass(frozen=True)
class CamExtraConfig(ExtraConfig):
    connector: ClassVar[str] = "CAMAsyncAFDConnector"
    dynamicQuant: int = _spec(0, choices=(0, 1), doc="1: dispatch rows as int8 + scale")  # noqa: N815


SCHEMAS: dict[str, type[ExtraConfig]] = {
    s.connector: s for s in (GpuExtraConfig, HostExtraConfig, CamExtraConfig)
}


def parse_extra(connector: str, raw: Mapping[str, Any]) -> ExtraConfig:
    """``raw`` checked against ``connector``'s schema (see the module docstring)."""
    schema = SCHEMAS.get(connector)
    if schema is None:
        raise AFDConfigError(f"afd.connector must be one of {sorted(SCHEMAS)}, got {connector!r}")
    known = {f.name: f for f in fields(schema)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        spec = known.get(key)
        where = f"afd.connector_extra_config.{key}"
        if spec is None:
            raise AFDConfigError(
                f"unknown key {where} for {connector}; its keys are {sorted(known)}"
            )
        values[key] = _check(where, spec.type, spec.metadata, value)
    extra = schema(**values)
    if isinstance(extra, WindowExtraConfig) and extra.ring_depth < extra.num_stages:
        raise AFDConfigError(
            f"afd.connector_extra_config.ring_depth ({extra.ring_depth}) must be at least "
            f"async_moe_num_ubatches ({extra.num_stages}): one dispatch per stage is in flight"
        )
    return extra


def _check(where: str, kind: Any, meta: Mapping[str, Any], value: Any) -> Any:
    if kind == "bool":
        out: Any = coerce_bool(where, value)
    elif kind == "int":
        out = coerce_int(where, value)
    elif kind == "float":
        out = coerce_float(where, value)
    elif isinstance(value, str):
        out = value.strip()
    else:
        raise AFDConfigError(f"{where} must be a string, got {value!r}")
    choices = meta.get("choices")
    if choices is not None and out not in choices:
        raise AFDConfigError(f"{where} must be one of {list(choices)}, got {value!r}")
    low, high = meta.get("low"), meta.get("high")
    if (low is not None and out < low) or (high is not None and out > high):
        raise AFDConfigError(f"{where} must be in {low:g}..{high:g}, got {value!r}")
    return out
