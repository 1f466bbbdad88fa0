"""Give Triton's interpreter a numpy path for ``tl.xor_sum``, the reduction of the header
CRC (``device_pack._crc_of``).

The interpreter reduces ``sum``, ``min`` and ``max`` with numpy but every other combine
function one element pair at a time in Python: a pack's headers spent 3.7 of 4.0 s there
(``cProfile``, 4 FFN ranks), and the pack group ran past the 120 s test timeout on a busy
CI machine. The kernels are unchanged -- only how the interpreter evaluates one standard
reduction -- and every CRC it computes is still checked by ``decode_header`` on the host.
With a Triton whose interpreter lacks the hooks used here the reduction stays on the slow
path (same results, only slower).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def install() -> bool:
    """Route the interpreter's XOR reductions through ``numpy.bitwise_xor.reduce``; whether
    the hook could be installed. Call before any kernel runs (with ``TRITON_INTERPRET=1``)."""
    try:
        from triton.language import standard
        from triton.runtime.interpreter import ReduceOps
    except ImportError:
        return False
    xor_combine = getattr(standard, "_xor_combine", None)
    generic = getattr(ReduceOps, "apply_impl", None)
    if getattr(generic, "_afd_xor", False):
        return True  # installed already
    if xor_combine is None or generic is None:
        return False

    def apply_impl(self: Any, input: Any) -> Any:
        if self.combine_fn == xor_combine and len(input) == 1:
            data = np.bitwise_xor.reduce(
                input[0].handle.data, axis=self.axis, keepdims=self.keep_dims
            )
            return self.to_tensor(data, input[0].dtype)
        return generic(self, input)

    apply_impl._afd_xor = True  # type: ignore[attr-defined]
    ReduceOps.apply_impl = apply_impl
    return True
