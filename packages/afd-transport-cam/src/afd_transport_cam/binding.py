"""The four CAM communication operators as the endpoints call them: emulated or real.

:class:`CamOperators` is the table of the four compact routed-only operators (same
positional arguments on both sides). :data:`EMULATED` holds the CPU emulator's functions;
:func:`load_npu_operators` finds the real ones under ``torch.ops.afd_ascend`` on an Ascend
machine. Nothing here imports ``torch_npu`` at package import time: only
:func:`load_npu_operators` does, and when it cannot it raises :class:`CamUnavailable`
saying what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from afd_protocol import AFDError
from afd_transport_cam.emulator import ops

NAMESPACE = "afd_ascend"
OPERATOR_NAMES = (
    "afd_async_dispatch_send",
    "afd_async_dispatch_recv",
    "afd_async_combine_send",
    "afd_async_combine_recv",
)
SUPPORTED = (
    "Ascend 910B / 910C (Atlas A2 / A3) with CANN 8.1 or later, torch-npu built for the "
    "installed torch (2.11 or later), and the CAM compact routed-only operators "
    "(afd_ascend.afd_async_*, built from the AFD plugin's NPU kernels)"
)


class CamUnavailable(AFDError, ImportError):
    """The real CAM operators cannot be loaded here (the message says what is missing)."""


@dataclass(frozen=True)
class CamOperators:
    """The four operators, called with their published positional arguments."""

    dispatch_send: Callable[..., Any]
    dispatch_recv: Callable[..., Any]
    combine_send: Callable[..., Any]
    combine_recv: Callable[..., Any]
    device_type: str
    """Where their tensors live: ``cpu`` for the emulator, ``npu`` for the real ones."""


EMULATED = CamOperators(
    ops.afd_async_dispatch_send,
    ops.afd_async_dispatch_recv,
    ops.afd_async_combine_send,
    ops.afd_async_combine_recv,
    device_type="cpu",
)


def load_npu_operators() -> CamOperators:
    """The real operators, or :class:`CamUnavailable` naming what to install."""
    try:
        importlib.import_module("torch_npu")
    except ImportError as exc:
        raise CamUnavailable(
            f"the CAM operators need torch_npu, which is not importable here ({exc}); on an "
            f"Ascend machine install afd-vllm[ascend] (it pulls vllm-ascend and torch-npu). "
            f"Supported: {SUPPORTED}. Without an NPU, use the CPU emulator "
            f"(afd run --transport cam-emulator)"
        ) from None
    namespace = getattr(torch.ops, NAMESPACE)
    missing = [name for name in OPERATOR_NAMES if not hasattr(namespace, name)]
    if missing:
        raise CamUnavailable(
            f"torch_npu is loaded but torch.ops.{NAMESPACE} lacks {missing}: build and load the "
            f"CAM compact operator library before connecting. Supported: {SUPPORTED}"
        )
    send, recv, reply, combine = (getattr(namespace, name) for name in OPERATOR_NAMES)
    return CamOperators(send, recv, reply, combine, device_type="npu")
