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

from collections import Counter
from collections.abc import Iterable

import torch

from afd_models import DeepseekConfig
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.devices import Placement
from afd_tools.run.hardware import nvidia_smi

GIB = 1 << 30

AFD_MODES = ("async", "sync")
"""The modes that start FFN ranks (colocated runs the model on its own ranks)."""


def routed_expert_bytes(config: DeepseekConfig, dtype: str) -> int:
    """Bytes of every MoE layer's routed experts (gate, up and down projections)."""
    itemsize: int = getattr(torch, dtype).itemsize
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * itemsize
    return len(config.moe_layers) * config.n_routed_experts * per_expert


def largest_gpu_memory() -> int | None:
    """The total memory of the largest GPU ``nvidia-smi`` lists, in bytes (not mapped to a
    CUDA device: nvidia-smi's order can differ from CUDA's, and the largest keeps the check
    a lower bound on any machine); ``None`` where nvidia-smi cannot say."""
    rows = nvidia_smi(("memory.total",))
    if isinstance(rows, str) or not all(size.isdigit() for (size,) in rows):
        return None
    return max(int(size) for (size,) in rows) << 20  # MiB


def check_experts_fit(
    config: DeepseekConfig,
    dtype: str,
    placement: Placement,
    modes: Iterable[str],
    gpu_bytes: int | None = None,
) -> None:
    """Refuse a placement whose FFN ranks' routed experts alone exceed a GPU's memory,
    naming the GPU, both sizes and what to change. Nothing to check on the CPU, or when no
    mode of ``modes`` starts FFN ranks. ``gpu_bytes``: a GPU's total memory (default:
    :func:`largest_gpu_memory`, read once); nothing is refused where it is unknown."""
    if placement.kind != "cuda" or not placement.ffn or not set(modes) & set(AFD_MODES):
        return
    total = largest_gpu_memory() if gpu_bytes is None else gpu_bytes
    if total is None:
        return
    share = routed_expert_bytes(config, dtype) / len(placement.ffn)
    for device, ranks in Counter(placement.ffn).items():
        needed = ranks * share
        if needed > total:
            raise WorkloadError(
                f"the routed experts do not fit {device}: its {ranks} FFN rank(s) hold "
                f"{needed / GIB:.1f} GiB of them ({len(config.moe_layers)} MoE layers x "
                f"{config.n_routed_experts} experts / {len(placement.ffn)} FFN ranks, "
                f"{dtype}), and the GPU has {total / GIB:.1f} GiB; use fewer --layers, or "
                f"more --ffn-ranks on more GPUs"
            )
