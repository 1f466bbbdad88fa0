# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""A grouped GEMM in Triton whose groups and layer are read on the device.

``y[rows of expert e] = x[rows of expert e] @ w[layer, e].T`` for rows grouped by expert
(ascending, the layout of :class:`~afd_models.experts.GroupedRows`), where the rows per
expert (``group_list``) and the layer index live in device tensors: nothing is read to the
host, so a call can be captured in a CUDA graph and replayed with new counts and a new
layer written into those tensors. ``w`` is one layer's experts ``[E, N, K]`` or every
layer's ``[L, E, N, K]`` stacked, selected by ``layer`` on the device (no weight copy).

Work is cut into tiles of ``BLOCK_M`` rows of one expert; the tile table (which expert and
first row each tile has) is computed by a few torch ops on the device from the group list.
A batch of ``N`` rows over ``E`` experts has at most ``ceil(N / BLOCK_M) + E`` tiles, so
the launch grid is fixed by the shapes alone; tiles past the last are idle programs.
Accumulation is float32; the output has the input's dtype. The reduction length ``K`` is a
compile-time constant (a model has two: the hidden and the expert intermediate size). On a
CPU tensor it runs only under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI
tests it.

This module imports Triton; :mod:`afd_models.backends` imports it only when the
``triton`` expert backend is selected.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch.nn import functional as nnf

from afd_models.errors import BackendUnavailable

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
"""Tile sizes (rows, output columns, reduction); the interpreter and the GPU use the same."""


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    layer_ptr,
    num_experts,
    n_out,
    stride_xm,
    stride_xk,
    stride_wl,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_IN: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < num_experts:
        row0 = tl.load(tile_row_ptr + tile)
        end = tl.load(offsets_ptr + expert + 1)
        layer = tl.load(layer_ptr)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < end
        col_ok = cols < n_out
        w_base = w_ptr + layer.to(tl.int64) * stride_wl + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K_IN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K_IN
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(
            y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
            acc.to(y_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def tile_table(
    group_list: torch.Tensor, num_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(offsets int64 [E + 1], tile_expert int32 [T], tile_row int64 [T])`` on the group
    list's device, ``T = ceil(num_rows / block_m) + E``: each tile's expert (``E`` for an
    idle tile) and first row. Device ops only (no host read)."""
    counts = group_list.to(torch.int64)
    experts = counts.numel()
    device = counts.device
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    total = -(-num_rows // block_m) + experts
    ids = torch.arange(total, dtype=torch.int64, device=device)
    expert = torch.searchsorted(tile_end, ids, right=True)
    owner = expert.clamp(max=max(experts - 1, 0))
    first_tile = tile_end - tiles
    tile_row = offsets[owner] + (ids - first_tile[owner]) * block_m
    return offsets, expert.to(torch.int32), tile_row


def _check_runs_here(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise BackendUnavailable(
        f"the triton grouped GEMM runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), "
        f"not on {t.device.type}; use expert backend 'reference' or 'grouped_mm' there"
    )


TileTable = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""What :func:`tile_table` returns; one table serves every GEMM over the same rows."""


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    group_list: torch.Tensor,
    layer: torch.Tensor | None = None,
    table: TileTable | None = None,
) -> torch.Tensor:
    """``[N, N_out]``: row block of expert ``e`` times ``w[layer, e].T`` (module docstring).

    ``x``: ``[N, K]`` rows grouped by expert; ``w``: ``[E, N_out, K]`` or ``[L, E, N_out,
    K]`` in ``x``'s dtype on its device; ``group_list``: int ``[E]`` rows per expert, summing
    to ``N``, on the device; ``layer``: int ``[1]`` on the device (required with a 4-D
    ``w``); ``table``: :func:`tile_table` of these rows at :data:`BLOCK_M` when the caller
    has it (two GEMMs over the same rows share one)."""
    _check_runs_here(x)
    if w.dim() == 3:
        if layer is not None:
            raise ValueError("layer selects among stacked layers: pass w as [L, E, N_out, K]")
        w = w.unsqueeze(0)
    if w.dim() != 4:
        raise ValueError(f"w must be [E, N_out, K] or [L, E, N_out, K], got {tuple(w.shape)}")
    if layer is None:
        layer = torch.zeros(1, dtype=torch.int32, device=x.device)
    _, experts, n_out, k_in = w.shape
    if x.dim() != 2 or x.shape[1] != k_in:
        raise ValueError(f"x must be [N, {k_in}] for w of shape {tuple(w.shape)}")
    if group_list.numel() != experts:
        raise ValueError(f"group_list has {group_list.numel()} entries for {experts} experts")
    if x.dtype != w.dtype:
        raise TypeError(f"x is {x.dtype} but w is {w.dtype}")
    num_rows = x.shape[0]
    y = torch.empty(num_rows, n_out, dtype=x.dtype, device=x.device)
    if num_rows == 0 or experts == 0:
        return y
    if table is None:
        table = tile_table(group_list.to(x.device), num_rows, BLOCK_M)
    offsets, tile_expert, tile_row = table
    grid = (tile_expert.numel(), triton.cdiv(n_out, BLOCK_N))
    # Triton launches on the current device: make it the tensors' (an FFN rank on cuda:1).
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _grouped_gemm_kernel[grid](
            x, w, y, offsets, tile_expert, tile_row, layer.to(x.device),
            experts, n_out,
            x.stride(0), x.stride(1),
            w.stride(0), w.stride(1), w.stride(2), w.stride(3),
            y.stride(0), y.stride(1),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, K_IN=k_in,
            IEEE=x.dtype == torch.float32,
        )  # fmt: skip
    return y


def expert_step(
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    group_list: torch.Tensor,
    layer: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N, H]``: every row through its expert, unit weight -- gate/up GEMM, SwiGLU, down
    GEMM, the two GEMMs sharing one tile table (the same rows).

    ``rows``: ``[N, H]`` grouped by expert; ``gate_up``: ``[E, 2I, H]`` and ``down``:
    ``[E, H, I]``, or every layer's ``[L, E, ...]`` with ``layer`` (int ``[1]``) on the
    device selecting one; ``group_list``: int ``[E]`` rows per expert on the device."""
    inter = down.shape[-1]
    table = None
    if rows.shape[0] and group_list.numel():
        table = tile_table(group_list.to(rows.device), rows.shape[0], BLOCK_M)
    hidden = grouped_gemm(rows, gate_up, group_list, layer, table)
    hidden = (nnf.silu(hidden[:, :inter]) * hidden[:, inter:]).contiguous()
    return grouped_gemm(hidden, down, group_list, layer, table)
