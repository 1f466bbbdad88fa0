"""Do the FFN ranks' routed experts fit their GPUs? Checked before any process starts.

A model too large for its GPU otherwise fails a minute into ``afd run``, as a CUDA
out-of-memory error inside a rank process (v3-slice's 4 layers of 256 experts are 84 GiB
of bf16 weights, where an H100 has 79 GiB). The check counts only the routed experts each
FFN rank holds (its share of every MoE layer's experts), summed over the ranks placed on
each GPU: a lower bound of what the GPU must hold (attention weights, activations, the
transport's heap and the verification come on top), so it never refuses a job that fits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd_models import DeepseekConfig
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.devices import Placement

GIB = 1 << 30

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def routed_expert_bytes(config: DeepseekConfig, dtype: str) -> int:
    """Bytes of every MoE layer's routed experts (gate, up and down projections)."""
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * DTYPE_BYTES[dtype]
    return len(config.moe_layers) * config.n_routed_experts * per_expert


def gpu_memory(device: str) -> int:
    """Total memory of a CUDA device, in bytes."""
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def check_experts_fit(
    config: DeepseekConfig,
    dtype: str,
    placement: Placement,
    memory: Callable[[str], int] | None = None,
) -> None:
    """Refuse a placement whose FFN ranks' routed experts alone exceed a GPU's memory,
    naming the GPU, both sizes and what to change. Nothing to check on the CPU.
    ``memory``: a device's total bytes (default :func:`gpu_memory`)."""
    if placement.kind != "cuda" or not placement.ffn:
        return
    memory = memory or gpu_memory
    share = routed_expert_bytes(config, dtype) / len(placement.ffn)
    held: dict[str, float] = {}
    for device in placement.ffn:
        held[device] = held.get(device, 0.0) + share
    for device, needed in held.items():
        total = memory(device)
        if needed > total:
            ranks = sum(1 for d in placement.ffn if d == device)
            raise WorkloadError(
                f"the routed experts do not fit {device}: its {ranks} FFN rank(s) hold "
                f"{needed / GIB:.1f} GiB of them ({len(config.moe_layers)} MoE layers x "
                f"{config.n_routed_experts} experts / {len(placement.ffn)} FFN ranks, "
                f"{dtype}), and the GPU has {total / GIB:.1f} GiB; use fewer --layers, or "
                f"more --ffn-ranks on more GPUs"
            )
