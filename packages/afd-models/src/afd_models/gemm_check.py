"""A start-up probe: does this GPU's GEMM library write every element of its outputs?

Measured on one H200 (torch 2.11 + CUDA 13, driver 580) as a CUDA MPS client: at 42 and 52
SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` 33 and 40) cuBLAS left elements of bf16
``torch.mm`` outputs unwritten for most row counts of every V2-Lite projection shape (its
workspace, reduced-precision reduction and the cuBLASLt path changed nothing), while 32,
66 and 132 SMs wrote everything. An unwritten element keeps whatever the allocator's
block held before -- a NaN, or worse a plausible stale number -- so a rank on such a share
computes wrong results silently. :func:`check_gemms_write_every_output` runs the probe in a
few milliseconds and raises :class:`~afd_models.errors.DeviceError` before any work; every
model of this package (monolithic, attention role, FFN role) calls it when it is built on a
CUDA device, once per device and process.

The probe: outputs filled with NaN, ``torch.mm(x, w.t(), out=out)`` (beta 0: the library
must not read ``out``), any NaN left is an element never written. The inputs are finite.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from afd_models.errors import DeviceError

PROBE_SHAPES: tuple[tuple[int, int], ...] = (
    (2048, 2816),
    (1408, 2048),
    (2048, 3072),
    (2048, 576),
    (512, 4096),
    (2048, 2048),
    (7168, 2048),
)
"""``(K, N)`` of the probe GEMMs ``x[M, K] @ w[N, K].T``: V2-Lite's expert, attention and
shared-expert projections (every one failed at 42 and 52 SMs) and one V3-width input."""
PROBE_ROWS: tuple[int, ...] = (1, 9, 33, 49, 100, 510, 1024)
"""``M`` of the probe GEMMs (row counts at which the failures above began)."""
PROBE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)


def unwritten_outputs(
    device: torch.device | str,
    shapes: Sequence[tuple[int, int]] = PROBE_SHAPES,
    rows: Sequence[int] = PROBE_ROWS,
    dtypes: Sequence[torch.dtype] = PROBE_DTYPES,
) -> list[str]:
    """The probe GEMMs on ``device`` that left output elements unwritten, one line each
    (``"bfloat16 [49 x 1408] @ [1408 x 2048]: 3 of 100352 elements unwritten"``); empty
    when every output was written. The inputs are drawn on ``device`` with a generator of
    the probe's own (the process's random state is left as it was)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    found: list[str] = []
    for dtype in dtypes:
        for k, n in shapes:
            weight = torch.randn(n, k, generator=generator, device=device).to(dtype)
            inputs = torch.randn(max(rows), k, generator=generator, device=device).to(dtype)
            for m in rows:
                out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                torch.mm(inputs[:m], weight.t(), out=out)
                missing = int(torch.isnan(out).sum())
                if missing:
                    name = str(dtype).removeprefix("torch.")
                    found.append(
                        f"{name} [{m} x {k}] @ [{k} x {n}]: {missing} of {m * n} elements unwritten"
                    )
    return found


def check_gemms_write_every_output(device: torch.device | str) -> None:
    """Raise :class:`DeviceError` when the probe finds a GEMM that leaves output elements
    unwritten on ``device`` (a CUDA device; nothing is checked elsewhere). Once per device
    and process."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    _check_cuda(index)


@functools.cache
def _check_cuda(index: int) -> None:
    found = unwritten_outputs(torch.device("cuda", index))
    if not found:
        return
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    where = f"cuda:{index} ({sms} SMs" + (f", a CUDA MPS client at {share} %)" if share else ")")
    shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    raise DeviceError(
        f"the GEMM library on {where} leaves output elements unwritten in {len(found)} of "
        f"{len(PROBE_SHAPES) * len(PROBE_ROWS) * len(PROBE_DTYPES)} probe products ({shown}), "
        f"so results here would be wrong. As an MPS client, use another SM share (25 % "
        f"and 50 % of an H200 were right with CUDA 13; 33 % and 40 % were not) or the "
        f"whole GPU"
    )


__all__ = ["PROBE_SHAPES", "check_gemms_write_every_output", "unwritten_outputs"]
