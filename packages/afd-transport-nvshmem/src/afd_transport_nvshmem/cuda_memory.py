"""Raw device addresses as torch tensors, and CUDA stream memory operations.

Windows live in NVSHMEM's symmetric heap, which torch did not allocate: a small object
exposing ``__cuda_array_interface__`` turns an address into a ``uint8`` tensor without
copying (the heap outlives every such view; the transport frees it last).

Stream memory operations (``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` from
``cuda-bindings``) let a stream publish or await a flag word without a kernel or a host
round trip. A default ``cuStreamWriteValue32`` is preceded by a system-scope memory fence
for the stream's earlier work, which is exactly "payload visible before flag".
"""

from __future__ import annotations

from typing import Any

import torch

try:  # cuda-bindings >= 12.6 ships ``cuda.bindings``; older cuda-python only ``cuda``
    from cuda.bindings import driver as _driver
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from cuda import cuda as _driver
    except ImportError:
        _driver = None


class _CudaArray:
    """The minimal ``__cuda_array_interface__`` provider for a byte range."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def device_bytes(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``uint8`` tensor over ``nbytes`` at device ``address`` (no copy, no ownership)."""
    if address == 0:
        raise ValueError("cannot view a NULL device address")
    return torch.as_tensor(_CudaArray(address, nbytes), device=device)


def stream_memops_available() -> bool:
    return _driver is not None


def check_result(result: Any, what: str) -> None:
    """Raise unless ``result`` (a ``CUresult``, or a call's result tuple led by one) is
    success."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: CUresult {int(err)}")


def stream_write_value32(address: int, value: int, stream: torch.cuda.Stream) -> None:
    """Enqueue "fence, then write ``value`` to ``address``" on ``stream``."""
    assert _driver is not None
    result = _driver.cuStreamWriteValue32(
        _driver.CUstream(stream.cuda_stream),
        _driver.CUdeviceptr(address),
        value & 0xFFFFFFFF,
        _driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
    )
    check_result(result, "cuStreamWriteValue32")


def stream_wait_value32_geq(address: int, value: int, stream: torch.cuda.Stream) -> None:
    """Enqueue "wait until the word at ``address`` >= ``value``" on ``stream``."""
    assert _driver is not None
    result = _driver.cuStreamWaitValue32(
        _driver.CUstream(stream.cuda_stream),
        _driver.CUdeviceptr(address),
        value & 0xFFFFFFFF,
        _driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
    )
    check_result(result, "cuStreamWaitValue32")
