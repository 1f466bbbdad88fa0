"""Run afd_models' Triton grouped GEMM on the CPU through Triton's interpreter (started by
test_triton_experts.py with TRITON_INTERPRET=1, which must be set before Triton compiles
anything) against the reference expert backend and plain matmuls; prints one line per
check and "triton grouped gemm: ok" at the end."""

from __future__ import annotations

import os
import sys

import torch

from afd_models import ExpertWeights, GroupedRows, get_expert_backend
from afd_models import triton_grouped_gemm as tgg


def experts(e: int, hidden: int, inter: int, seed: int) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(e, hidden, inter, generator=gen) / inter**0.5
    return ExpertWeights(0, tuple(range(e)), gate_up, down)


def check_backend(counts: list[int], hidden: int, inter: int) -> None:
    weights = experts(len(counts), hidden, inter, seed=sum(counts))
    rows = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(7))
    work = GroupedRows(rows, torch.tensor(counts))
    got = get_expert_backend("triton")(work, weights)
    want = get_expert_backend("reference")(work, weights)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all(), "non-finite output"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print(f"backend counts={counts} hidden={hidden} inter={inter}: ok")


def check_layer_select() -> None:
    """Stacked layers, the layer read from a device tensor: rewriting it selects another
    layer's weights without touching the launch arguments."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 2, 24, 40, generator=gen)  # [L, E, N_out, K]
    x = torch.randn(37, 40, generator=gen)
    counts = torch.tensor([20, 17])
    layer = torch.tensor([2], dtype=torch.int32)
    for chosen in (2, 0):
        layer.fill_(chosen)
        got = tgg.grouped_gemm(x, w, counts, layer)
        want = torch.cat([x[:20] @ w[chosen, 0].T, x[20:] @ w[chosen, 1].T])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print("layer select by a device index: ok")


def check_expert_stack() -> None:
    """An FFN rank's ExpertStack: the device layer index over the stacked weights gives what
    the per-layer views give."""
    from afd_models import FFNRoleExecutor, preset

    config = preset("tiny")
    executor = FFNRoleExecutor(config, range(config.n_routed_experts // 2), backend="triton")
    stack = executor.stack
    counts = torch.tensor([3, 0, 9] + [1] * (len(stack.expert_ids) - 3))
    x = torch.randn(
        int(counts.sum()), config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    for layer in stack.moe_layers:
        index = torch.tensor([stack.position(layer)], dtype=torch.int32)
        got = tgg.grouped_gemm(x, stack.gate_up, counts, index)
        want = tgg.grouped_gemm(x, stack.layer(layer).gate_up, counts)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    print(f"expert stack of {len(stack.moe_layers)} MoE layers, selected on the device: ok")


def check_graphed_experts() -> None:
    """The bucketed step (eager here: no CUDA) equals the backend for every layer, a big
    item then small ones (stale rows in the static buffer), an item beyond every bucket,
    and no rows."""
    from afd_models import FFNRoleExecutor, preset
    from afd_models.graphed_experts import GraphedExperts

    config = preset("tiny")
    executor = FFNRoleExecutor(config, range(4), backend="triton", graph_buckets=(16, 64))
    graphed = executor.graphed
    assert isinstance(graphed, GraphedExperts)
    assert not graphed.capture
    assert graphed.buckets == (16, 64)
    gen = torch.Generator().manual_seed(9)
    for n in (60, 5, 16, 17, 0, 150):
        counts = torch.zeros(4, dtype=torch.int64)
        if n:
            counts = torch.bincount(torch.randint(0, 4, (n,), generator=gen), minlength=4)
        rows = torch.randn(n, config.hidden_size, generator=gen)
        work = GroupedRows(rows, counts)
        for layer in config.moe_layers:
            got = graphed(layer, work)
            want = executor.backend(work, executor.experts[layer])
            assert got.shape == (n, config.hidden_size), got.shape
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    print("graphed experts over buckets (16, 64), eager on CPU: ok")


def check_device_expert_step() -> None:
    """FFNRoleExecutor.device_expert_step: over a static buffer larger than the item (its
    tail holds another item's rows) and with the *model* layer index in a device tensor, the
    first rows equal the backend's output for every MoE layer."""
    from afd_models import FFNRoleExecutor, preset

    config = preset("tiny")
    executor = FFNRoleExecutor(config, range(4), backend="triton")
    step = executor.device_expert_step()
    gen = torch.Generator().manual_seed(5)
    buffer = torch.randn(96, config.hidden_size, generator=gen)
    for n in (40, 7, 0):
        counts = torch.zeros(4, dtype=torch.int64)
        if n:
            counts = torch.bincount(torch.randint(0, 4, (n,), generator=gen), minlength=4)
        rows = torch.randn(n, config.hidden_size, generator=gen)
        buffer[:n] = rows
        for layer in config.moe_layers:
            got = step(buffer, counts, torch.tensor([layer], dtype=torch.int32))
            assert got.shape == buffer.shape, got.shape
            want = executor.backend(GroupedRows(rows, counts), executor.experts[layer])
            torch.testing.assert_close(got[:n], want, rtol=1e-6, atol=1e-6)
    print("device expert step over a static buffer, model layer on the device: ok")


def check_tile_table() -> None:
    counts = [0, 33, 1, 36, 0]
    offsets, expert, row = tgg.tile_table(torch.tensor(counts), sum(counts), 16)
    want_expert, want_row = [], []
    start = 0
    for e, n in enumerate(counts):
        for t in range(-(-n // 16)):
            want_expert.append(e)
            want_row.append(start + 16 * t)
        start += n
    total = -(-sum(counts) // 16) + len(counts)
    assert expert.tolist()[: len(want_expert)] == want_expert, expert.tolist()
    assert row.tolist()[: len(want_row)] == want_row, row.tolist()
    assert all(e == len(counts) for e in expert.tolist()[len(want_expert) :])  # idle tiles
    assert expert.numel() == total
    assert offsets.tolist() == [0, 0, 33, 34, 70, 70]
    print("tile table: ok")


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    check_tile_table()
    # Default tiles, then small ones so that experts span several tiles and tiles end
    # mid-expert; an empty expert, a one-row expert, sizes that are no multiple of a tile.
    check_backend([0, 33, 1, 36], hidden=24, inter=20)
    tgg.BLOCK_M, tgg.BLOCK_N, tgg.BLOCK_K = 16, 16, 16
    check_backend([0, 33, 1, 36], hidden=24, inter=20)
    check_backend([5, 0, 0, 70, 2, 1], hidden=40, inter=9)
    check_backend([0, 0, 0], hidden=16, inter=16)  # no rows at all
    check_layer_select()
    check_expert_stack()
    check_graphed_experts()
    check_device_expert_step()
    print("triton grouped gemm: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
