"""The emulated operators registered as torch operators, under the real ones' names.

``register_emulated_ops()`` defines ``torch.ops.afd_ascend.afd_async_{dispatch,combine}_
{send,recv}`` with the compact generation's schemas and CPU implementations, and the two
layer-select GEMMs (``gmm_swiglu_quant_v2_layered``, ``grouped_matmul_layered``) with
their references, so code written against the NPU operators runs unchanged on a CPU. It
refuses when the namespace already holds real operators (a machine with the NPU package
loaded), and registering twice is a no-op.
"""

from __future__ import annotations

import threading

import torch

from afd_protocol import InvalidArgument
from afd_transport_cam.emulator import gemm, ops

NAMESPACE = "afd_ascend"

SCHEMAS = {
    "afd_async_dispatch_send": (
        "(Tensor x, Tensor expert_ids, Tensor comm_args, int comm_id, int max_seq_len, "
        "int batch_size, int hidden_size, int top_k, int moe_rank_num, int attn_rank_num, "
        "int route_expert_num_per_moe, int attn_rank_id, int world_size, int layer_index, "
        "int tp_size, int dynamic_quant, str group_name) -> Tensor"
    ),
    "afd_async_dispatch_recv": (
        "(Tensor x, Tensor comm_args, int comm_id, int max_seq_len, int hidden_size, "
        "int top_k, int moe_rank_num, int attn_rank_num, int route_expert_num_per_moe, "
        "int moe_rank_id, int world_size, int tp_size, int dynamic_quant, str group_name) "
        "-> Tensor[]"
    ),
    "afd_async_combine_send": (
        "(Tensor expand_x, Tensor comm_args, Tensor batch_info, int comm_id, int max_seq_len, "
        "int hidden_size, int top_k, int moe_rank_num, int attn_rank_num, "
        "int route_expert_num_per_moe, int moe_rank_id, int world_size, int tp_size, "
        "str group_name) -> Tensor"
    ),
    "afd_async_combine_recv": (
        "(Tensor expand_x, Tensor expert_ids, Tensor expert_scales, Tensor comm_args, "
        "int comm_id, int batch_size, int hidden_size, int top_k, int moe_rank_num, "
        "int attn_rank_num, int route_expert_num_per_moe, int attn_rank_id, int world_size, "
        "str group_name) -> Tensor"
    ),
    "gmm_swiglu_quant_v2_layered": (
        "(Tensor x, Tensor[] all_weight, Tensor[] all_weight_scale, "
        "Tensor[] all_weight_assist_matrix, Tensor x_scale, Tensor group_list, "
        "Tensor layer_index, int dequant_mode=0, int quant_mode=0, int group_list_type=0, "
        "int[]? tuning_config=None) -> Tensor[]"
    ),
    "grouped_matmul_layered": (
        "(Tensor[] x, Tensor[] all_weight, Tensor[] all_bias, Tensor[] all_scale, "
        "Tensor layer_index, Tensor group_list, Tensor? per_token_scale=None, "
        "int group_list_type=1, int split_item=3, ScalarType? output_dtype=None) -> Tensor[]"
    ),
}
"""The compact routed-only generation's communication operators and the two layer-select
GEMM operators, with their published schemas."""

_LIBRARY: torch.library.Library | None = None
_LOCK = threading.Lock()


def register_emulated_ops() -> None:
    """Define the four operators under ``torch.ops.afd_ascend`` with CPU implementations."""
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is not None:
            return
        existing = [name for name in SCHEMAS if hasattr(getattr(torch.ops, NAMESPACE), name)]
        if existing:
            raise InvalidArgument(
                f"torch.ops.{NAMESPACE} already defines {existing}: the real CAM operators are "
                f"loaded in this process, so the emulator will not shadow them"
            )
        library = torch.library.Library(NAMESPACE, "FRAGMENT")  # type: ignore[no-untyped-call]
        for name, schema in SCHEMAS.items():
            library.define(name + schema)  # type: ignore[no-untyped-call]
            implementation = getattr(ops, name, None) or getattr(gemm, name)
            library.impl(name, implementation, "CPU")  # type: ignore[no-untyped-call]
        _LIBRARY = library


def emulated_ops_registered() -> bool:
    return _LIBRARY is not None
