"""Do the FFN ranks' routed experts fit their GPUs? Checked before any process starts.

A model too large for its GPU otherwise fails a minute into ``afd run``, as a CUDA
out-of-memory error inside a rank process (v3-slice's 4 layers of 256 experts are 84 GiB
of bf16 weights, where an H100 has 79.6 GiB). The check counts only the routed experts each
FFN rank holds (its share of every MoE layer's experts), summed over the ranks placed on
each GPU: a lower bound of what the GPU must hold (attention weights, activations, the
transport's heap and the verification come on top), so it never refuses a job that fits.

The GPUs' memory is read from ``nvidia-smi``, not through torch: ``afd run``'s own process
must not create a CUDA context before the ranks start (they are CUDA MPS clients of a
daemon started after this check). Where ``nvidia-smi`` cannot say, nothing is refused.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable

from afd_models import DeepseekConfig
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.devices import Placement

GIB = 1 << 30

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

AFD_MODES = ("async", "sync")
"""The modes that start FFN ranks (colocated runs the model on its own ranks)."""


def routed_expert_bytes(config: DeepseekConfig, dtype: str) -> int:
    """Bytes of every MoE layer's routed experts (gate, up and down projections)."""
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * DTYPE_BYTES[dtype]
    return len(config.moe_layers) * config.n_routed_experts * per_expert


def largest_gpu_memory(device: str) -> int | None:
    """The total memory of the largest GPU ``nvidia-smi`` lists, in bytes (``device`` is
    not mapped to nvidia-smi's index, whose order can differ from CUDA's: the largest
    keeps the check a lower bound on any machine); ``None`` where nvidia-smi cannot say."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [line.strip() for line in listed.splitlines() if line.strip()]
    if not sizes or not all(size.isdigit() for size in sizes):
        return None
    return max(int(size) for size in sizes) << 20  # MiB


def check_experts_fit(
    config: DeepseekConfig,
    dtype: str,
    placement: Placement,
    modes: Iterable[str],
    memory: Callable[[str], int | None] | None = None,
) -> None:
    """Refuse a placement whose FFN ranks' routed experts alone exceed a GPU's memory,
    naming the GPU, both sizes and what to change. Nothing to check on the CPU, or when no
    mode of ``modes`` starts FFN ranks. ``memory``: a device's total bytes, ``None`` if
    unknown (default :func:`largest_gpu_memory`)."""
    if placement.kind != "cuda" or not placement.ffn or not set(modes) & set(AFD_MODES):
        return
    memory = memory or largest_gpu_memory
    share = routed_expert_bytes(config, dtype) / len(placement.ffn)
    held: dict[str, float] = {}
    for device in placement.ffn:
        held[device] = held.get(device, 0.0) + share
    for device, needed in held.items():
        total = memory(device)
        if total is not None and needed > total:
            ranks = sum(1 for d in placement.ffn if d == device)
            raise WorkloadError(
                f"the routed experts do not fit {device}: its {ranks} FFN rank(s) hold "
                f"{needed / GIB:.1f} GiB of them ({len(config.moe_layers)} MoE layers x "
                f"{config.n_routed_experts} experts / {len(placement.ffn)} FFN ranks, "
                f"{dtype}), and the GPU has {total / GIB:.1f} GiB; use fewer --layers, or "
                f"more --ffn-ranks on more GPUs"
            )
