"""References of CAM's two layer-select routed-expert GEMM operators (CPU).

On the NPU the FFN rank's expert loop never puts the layer on the host: both operators take
every layer's weights and a one-element int64 ``layer_index`` tensor (from the receive's
batch information), so the loop can be captured in a graph. Here the index is read with
``.item()`` -- the device residency is part of the contract, not reproduced.

* :func:`grouped_matmul_layered` (W2): ``y[rows of group e] = x_e @ W[layer][e] (+ bias)``,
  in fp32; int8 activations and weights are multiplied exactly (int32 accumulate) and
  dequantised with the per-channel weight scale and the per-token activation scale.
* :func:`gmm_swiglu_quant_v2_layered` (W1): the int8 gate/up GEMM of the same shape,
  dequantised, then SwiGLU on its two halves (``silu(h[:, :I]) * h[:, I:]``, the NPU
  GMM-SwiGLU convention: the first half is activated) and per-token int8 quantisation of
  the result, ready for W2.

Groups are ``group_list`` counts (``group_list_type=1``) or cumulative ends (0). Rows past
the groups are zero in the output. Weight scales may be fp32 or the int64 encoding the NPU
kernels take (the fp32 bits in the low 32 bits); supported modes are per-channel scales
(``dequant_mode=0``) and per-token int8 outputs (``quant_mode=0``).
"""

from __future__ import annotations

import itertools

import torch

from afd_protocol import InvalidArgument
from afd_transport_cam.quant import quantize_per_token


def _layer(layer_index: torch.Tensor, count: int) -> int:
    if layer_index.numel() != 1 or layer_index.dtype != torch.int64:
        raise InvalidArgument(
            f"layer_index must be an int64 tensor of one element, got {layer_index.dtype} "
            f"{tuple(layer_index.shape)}"
        )
    layer = int(layer_index.reshape(-1)[0])
    if not 0 <= layer < count:
        raise InvalidArgument(f"layer_index {layer} is outside the {count} layers given")
    return layer


def _group_bounds(group_list: torch.Tensor, group_list_type: int, rows: int) -> list[int]:
    """Row offsets ``[0, end_0, end_1, ...]`` of the groups."""
    values = [int(v) for v in group_list.reshape(-1).tolist()]
    if group_list_type == 1:
        ends = []
        total = 0
        for count in values:
            if count < 0:
                raise InvalidArgument(f"group_list holds a negative count ({count})")
            total += count
            ends.append(total)
    elif group_list_type == 0:
        ends = values
        if any(b < a for a, b in zip([0, *ends], ends, strict=False)):
            raise InvalidArgument("group_list (cumulative, type 0) must not decrease")
    else:
        raise InvalidArgument(
            f"group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}"
        )
    if ends and ends[-1] > rows:
        raise InvalidArgument(f"group_list covers {ends[-1]} rows but x has {rows}")
    return [0, *ends]


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales from fp32, or from the NPU's int64 encoding (fp32 bits, low word)."""
    if scale.dtype == torch.int64:
        low = (scale & 0xFFFFFFFF).to(torch.int32)
        return low.view(torch.float32)
    return scale.float()


def _grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    bounds: list[int],
    scale: torch.Tensor | None,
    per_token_scale: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 ``[rows, N]``: each group's rows times its expert's weight, dequantised."""
    if weight.dim() != 3 or weight.shape[0] != len(bounds) - 1 or weight.shape[1] != x.shape[1]:
        raise InvalidArgument(
            f"weights must be [E={len(bounds) - 1}, K={x.shape[1]}, N], got {tuple(weight.shape)}"
        )
    quantised = x.dtype == torch.int8
    if quantised != (weight.dtype == torch.int8):
        raise InvalidArgument(
            f"x is {x.dtype} and the weights {weight.dtype}: both int8 (W8A8) or both floating"
        )
    out = torch.zeros(x.shape[0], weight.shape[2], dtype=torch.float32)
    for expert, (begin, end) in enumerate(itertools.pairwise(bounds)):
        if begin == end:
            continue
        rows = x[begin:end]
        if quantised:
            # Exact integer products (int32 accumulation), as the NPU's int8 GEMM.
            y = (rows.to(torch.int64) @ weight[expert].to(torch.int64)).float()
        else:
            y = rows.float() @ weight[expert].float()
        if scale is not None:
            y = y * decode_scale(scale)[expert].float()
        if per_token_scale is not None:
            y = y * per_token_scale[begin:end, None].float()
        out[begin:end] = y
    return out


def grouped_matmul_layered(
    x: list[torch.Tensor],
    all_weight: list[torch.Tensor],
    all_bias: list[torch.Tensor],
    all_scale: list[torch.Tensor],
    layer_index: torch.Tensor,
    group_list: torch.Tensor,
    per_token_scale: torch.Tensor | None = None,
    group_list_type: int = 1,
    split_item: int = 3,
    output_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """W2: the selected layer's grouped GEMM (module docstring); returns ``[y]``."""
    if len(x) != 1 or x[0].dim() != 2:
        raise InvalidArgument("x must be exactly one merged 2-D activation")
    if split_item != 3:
        raise InvalidArgument(f"split_item must be 3 (one merged output), got {split_item}")
    rows = x[0]
    layer = _layer(layer_index, len(all_weight))
    bounds = _group_bounds(group_list, group_list_type, rows.shape[0])
    scale = all_scale[layer] if all_scale else None
    out = _grouped(rows, all_weight[layer], bounds, scale, per_token_scale)
    if all_bias:
        for expert, (begin, end) in enumerate(itertools.pairwise(bounds)):
            out[begin:end] += all_bias[layer][expert].float()
    if output_dtype is None:
        output_dtype = torch.bfloat16 if rows.dtype == torch.int8 else rows.dtype
    return [out.to(output_dtype)]


def gmm_swiglu_quant_v2_layered(
    x: torch.Tensor,
    all_weight: list[torch.Tensor],
    all_weight_scale: list[torch.Tensor],
    all_weight_assist_matrix: list[torch.Tensor],
    x_scale: torch.Tensor,
    group_list: torch.Tensor,
    layer_index: torch.Tensor,
    dequant_mode: int = 0,
    quant_mode: int = 0,
    group_list_type: int = 0,
    tuning_config: list[int] | None = None,
) -> list[torch.Tensor]:
    """W1: int8 gate/up GEMM, SwiGLU, per-token int8; returns ``[y int8 [M, I], scale [M]]``."""
    del tuning_config  # a performance hint
    if dequant_mode != 0 or quant_mode != 0:
        raise InvalidArgument(
            f"dequant_mode={dequant_mode}, quant_mode={quant_mode}: the reference covers "
            f"per-channel weight scales and per-token int8 outputs (0, 0) only"
        )
    if x.dtype != torch.int8:
        raise InvalidArgument(f"x must be int8 (the dispatched rows), got {x.dtype}")
    layer = _layer(layer_index, len(all_weight))
    bounds = _group_bounds(group_list, group_list_type, x.shape[0])
    h = _grouped(x, all_weight[layer], bounds, all_weight_scale[layer], x_scale)
    if all_weight_assist_matrix:
        for expert, (begin, end) in enumerate(itertools.pairwise(bounds)):
            h[begin:end] += all_weight_assist_matrix[layer][expert].float()
    half = h.shape[1] // 2
    activated = torch.nn.functional.silu(h[:, :half]) * h[:, half:]
    valid = bounds[-1]
    y = torch.zeros(x.shape[0], half, dtype=torch.int8)
    scale = torch.zeros(x.shape[0], dtype=torch.float32)
    if valid:
        y[:valid], scale[:valid] = quantize_per_token(activated[:valid])
    return [y, scale]
