"""vLLM plugin for asynchronous AFD prefill.

Installed, it registers itself with vLLM through the ``vllm.general_plugins`` entry point
(:func:`register_afd`, called by vLLM in every process it starts). Nothing changes in vLLM
unless ``--additional-config`` carries an ``"afd"`` entry (:mod:`afd_vllm.config`).

Built so far: the configuration and its closed per-connector schemas, the connectors (thin
adapters over afd's transports, created lazily), and dispatch/combine as custom operators
that ``torch.compile`` keeps opaque. Not yet: the attention-role model runner and the FFN
role inside vLLM, and the version-gated patches (issue #15).
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-vllm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = False
"""False until the plugin runs inside vLLM end to end; callers can check it."""

SUPPORTED_VLLM = ((0, 32), (0, 33))
"""(major, minor) releases of vLLM the plugin supports."""

_registered = False


def supported_vllm(found: str) -> bool:
    """Whether vLLM ``found`` (a version string) is one the plugin supports."""
    parts = found.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return major_minor in SUPPORTED_VLLM


def check_vllm_version(found: str) -> None:
    """Raise :class:`~afd_vllm.extra.AFDConfigError` (one line naming the supported range)
    unless ``found`` is supported; called when an AFD configuration is used."""
    from afd_vllm.extra import AFDConfigError

    if not supported_vllm(found):
        wanted = " or ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
        raise AFDConfigError(f"afd-vllm supports vLLM {wanted}; found vLLM {found}")


def register_afd() -> None:
    """vLLM's plugin hook: idempotent, and a no-op where vLLM is not installed."""
    global _registered
    if _registered:
        return
    _registered = True
    if importlib.util.find_spec("vllm") is None:
        return
    # Registering the operators is cheap and changes nothing until they are called.
    import afd_vllm.ops  # noqa: F401
