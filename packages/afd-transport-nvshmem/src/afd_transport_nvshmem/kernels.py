"""The Triton kernels this package offers a window endpoint, as one
:class:`~afd_transport_nvshmem.kernel_specs.WindowKernels`.

Imported only when an endpoint is made (Triton is imported with it)."""

from __future__ import annotations

import functools

from afd_transport_nvshmem.kernel_specs import WindowKernels


@functools.cache
def triton_kernels() -> WindowKernels:
    """The fused combine, the device pack, the FFN-side reduce, the device plan, and the
    graphed dispatch's input fetch and word copies, on the current CUDA stream."""
    from afd_transport_nvshmem.device_pack import triton_device_pack
    from afd_transport_nvshmem.device_plan import triton_plan_on_device
    from afd_transport_nvshmem.fused_combine import triton_fused_combine
    from afd_transport_nvshmem.input_fetch import triton_fetch_inputs
    from afd_transport_nvshmem.reduce_partials import triton_reduce_partials
    from afd_transport_nvshmem.word_copy import triton_copy_words

    return WindowKernels(
        fused_combine=triton_fused_combine,
        device_pack=triton_device_pack,
        reduce_partials=triton_reduce_partials,
        device_plan=triton_plan_on_device,
        fetch_inputs=triton_fetch_inputs,
        copy_words=triton_copy_words,
    )
