"""Connector name -> class, imported only when selected, so that a CPU install never
imports NVSHMEM or torch-npu and a missing backend says which extra to install."""

from __future__ import annotations

import importlib

from afd_vllm.config import CONNECTORS, AFDConfig
from afd_vllm.connectors.base import AFDConnector, ModelGeometry
from afd_vllm.extra import AFDConfigError

_WHERE = {
    "GpuAsyncAFDConnector": ("afd_vllm.connectors.gpu", "afd-vllm[cuda]"),
    "CAMAsyncAFDConnector": ("afd_vllm.connectors.cam", "afd-vllm[ascend]"),
    "HostAsyncAFDConnector": ("afd_vllm.connectors.host", "afd-vllm"),
}
assert set(_WHERE) == set(CONNECTORS)


def connector_class(name: str) -> type[AFDConnector]:
    """The class of connector ``name`` (its backend imported now)."""
    if name not in _WHERE:
        raise AFDConfigError(f"afd.connector must be one of {list(CONNECTORS)}, got {name!r}")
    module, extra = _WHERE[name]
    try:
        loaded = importlib.import_module(module)
    except ImportError as exc:
        raise AFDConfigError(
            f"afd.connector {name} needs a backend that is not installed ({exc}); install "
            f"it with: pip install '{extra}'"
        ) from exc
    cls: type[AFDConnector] = getattr(loaded, name)
    return cls


def create_connector(config: AFDConfig, geometry: ModelGeometry) -> AFDConnector:
    """The connector ``config`` names, for a model of ``geometry``."""
    return connector_class(config.connector)(config, geometry)
