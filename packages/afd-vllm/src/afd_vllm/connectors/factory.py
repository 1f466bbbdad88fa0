"""Connector name -> class, imported only when selected, so that a CPU install never
imports NVSHMEM or torch-npu and a missing backend says which extra to install."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from afd_protocol import FIRST_PARTY_TRANSPORTS, transport_names
from afd_vllm.config import CONNECTORS, AFDConfig
from afd_vllm.connectors.base import AFDConnector, ModelGeometry
from afd_vllm.extra import AFDConfigError


@dataclass(frozen=True)
class _Backend:
    """Where a connector's class lives and what it needs installed."""

    module: str
    transport: str | None
    """The afd transport it runs on, by its name in ``afd_protocol``'s transport registry
    (None: CAM's NPU operators, which no launcher opens)."""
    extra: str
    """The pip requirement that installs its backend for vLLM."""


_WHERE = {
    "GpuAsyncAFDConnector": _Backend("afd_vllm.connectors.gpu", "nvshmem", "afd-vllm[cuda]"),
    "CAMAsyncAFDConnector": _Backend("afd_vllm.connectors.cam", None, "afd-vllm[ascend]"),
    "HostAsyncAFDConnector": _Backend("afd_vllm.connectors.host", "shm", "afd-vllm"),
}
assert set(_WHERE) == set(CONNECTORS)
assert all(b.transport in (None, *FIRST_PARTY_TRANSPORTS) for b in _WHERE.values())


def connector_class(name: str) -> type[AFDConnector]:
    """The class of connector ``name`` (its backend imported now)."""
    if name not in _WHERE:
        raise AFDConfigError(f"afd.connector must be one of {list(CONNECTORS)}, got {name!r}")
    backend = _WHERE[name]
    try:
        loaded = importlib.import_module(backend.module)
    except ImportError as exc:
        raise AFDConfigError(
            f"afd.connector {name} needs {_missing(backend)} ({exc}); install it with: "
            f"pip install '{backend.extra}'"
        ) from exc
    cls: type[AFDConnector] = getattr(loaded, name)
    return cls


def _missing(backend: _Backend) -> str:
    """What a connector whose import failed lacks: its transport, where the registry has
    no such transport here, or else some part of its backend."""
    if backend.transport is not None and backend.transport not in transport_names():
        package = FIRST_PARTY_TRANSPORTS[backend.transport]
        return f"the {backend.transport} transport ({package}), which is not installed"
    return "a backend that is not installed"


def create_connector(config: AFDConfig, geometry: ModelGeometry) -> AFDConnector:
    """The connector ``config`` names, for a model of ``geometry``."""
    return connector_class(config.connector)(config, geometry)
