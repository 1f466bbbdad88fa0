# Triton kernels take untyped compile-time arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""A few words copied between page-locked host memory and the device by one small kernel
(:data:`~afd_transport_nvshmem.kernel_specs.WordCopy`; its reference is
:func:`~afd_transport_nvshmem.kernel_specs.reference_copy_words`).

A graphed dispatch moves a few words across PCIe on every replay: its header words and
its inputs' addresses in, the expert-id bounds out. As ``copy_`` those are memcpy nodes
touching host memory, and each made the graph's launch cost the host about 5 µs more on
one H200 (`tools/gpu/graph_launch.py`: ten small kernels 4.3 µs, seven kernels and three
such copies 17.8 µs), a third of the 30 µs a layer's whole host time may take. A kernel
node costs a launch next to nothing: the kernel reads or writes the pinned buffer through
its device address (unified addressing maps page-locked memory into the device's address
space, as :class:`~afd_transport_nvshmem.device_wait.HostPointer` does for the waits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd_transport_nvshmem.device_wait import HostPointer
from afd_transport_nvshmem.kernel_specs import MAX_COPIED_WORDS

BLOCK = 256
"""Words per loop step of the one program."""


@triton.jit(do_not_specialize=["n"])
def _copy_words_kernel(source, destination, n, BLOCK: tl.constexpr):
    start = 0
    while start < n:  # (a runtime range() does not run in the interpreter)
        offsets = start + tl.arange(0, BLOCK)
        live = offsets < n
        words = tl.load(source + offsets, mask=live, volatile=True)
        tl.store(destination + offsets, words, mask=live)
        start += BLOCK


def _pointer(t: torch.Tensor, device: torch.device) -> torch.Tensor | HostPointer:
    """``t`` as a Triton pointer argument: itself on the device, its mapped address when
    it is page-locked host memory and the kernel runs on a GPU."""
    if t.device == device or device.type == "cpu":
        return t
    if t.device.type != "cpu":
        raise ValueError(
            f"copy_words copies between host memory and one device: got {t.device} and {device}"
        )
    if not t.is_pinned():
        raise ValueError(
            "copy_words reaches host memory only when it is page-locked (pin_memory=True): a "
            "kernel cannot address pageable memory"
        )
    return HostPointer(t)


def triton_copy_words(destination: torch.Tensor, source: torch.Tensor) -> None:
    """:data:`~afd_transport_nvshmem.kernel_specs.WordCopy` in one launch on the current
    stream (the current device must be the GPU side's: one tensor is on it, the other on
    it too or in page-locked host memory; under the interpreter both are on the CPU)."""
    if source.dtype != destination.dtype or source.numel() != destination.numel():
        raise ValueError(
            f"copy_words copies words of one dtype and count: got {source.dtype} "
            f"[{source.numel()}] into {destination.dtype} [{destination.numel()}]"
        )
    if not (source.is_contiguous() and destination.is_contiguous()):
        raise ValueError("copy_words copies contiguous words only")
    if source.numel() > MAX_COPIED_WORDS:
        raise ValueError(
            f"copy_words moves at most {MAX_COPIED_WORDS} words, got {source.numel()}: use "
            f"copy_ for bulk data"
        )
    device = destination.device if destination.device.type == "cuda" else source.device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        raise ValueError(
            f"copy_words launches on the current device, cuda:{torch.cuda.current_device()}, "
            f"but its device memory is on {device}: make that device current"
        )
    _copy_words_kernel[(1,)](
        _pointer(source, device), _pointer(destination, device), source.numel(), BLOCK=BLOCK
    )
