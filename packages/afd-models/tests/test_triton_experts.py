"""The ``triton`` expert backend: its grouped GEMM runs on the CPU under Triton's
interpreter, in a subprocess, against the reference backend (skipped without Triton); and
outside the interpreter a CPU tensor is refused with what to use instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from afd_models import BackendUnavailable, ExpertWeights, GroupedRows, get_expert_backend


def test_the_grouped_gemm_matches_the_reference_backend_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # the interpreter runs on NumPy
    script = Path(__file__).with_name("afd_grouped_gemm_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "triton grouped gemm: ok" in done.stdout


def test_a_cpu_tensor_outside_the_interpreter_is_refused_naming_the_alternatives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    weights = ExpertWeights(0, (0, 1), torch.zeros(2, 8, 4), torch.zeros(2, 4, 4))
    work = GroupedRows(torch.zeros(3, 4), torch.tensor([1, 2]))
    with pytest.raises(BackendUnavailable, match="use expert backend 'reference' or 'grouped_mm'"):
        get_expert_backend("triton")(work, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_the_triton_backend_matches_grouped_mm_at_v2_lite_shapes(
    dtype: torch.dtype,
) -> None:
    """V2-Lite expert shapes (hidden 2048, intermediate 1408, 16 local experts), uneven
    counts with empty experts: the compiled kernel against torch's grouped GEMM."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    local, hidden, inter = 16, 2048, 1408
    counts = torch.randint(0, 400, (local,), generator=gen, device="cuda")
    counts[[2, 9]] = 0
    rows = torch.randn(int(counts.sum()), hidden, generator=gen, device="cuda").to(dtype)
    gate_up = (torch.randn(local, 2 * inter, hidden, generator=gen, device="cuda") / 45).to(dtype)
    down = (torch.randn(local, hidden, inter, generator=gen, device="cuda") / 38).to(dtype)
    weights = ExpertWeights(0, tuple(range(local)), gate_up, down)
    work = GroupedRows(rows, counts)
    got = get_expert_backend("triton")(work, weights)
    want = get_expert_backend("grouped_mm")(work, weights)
    assert torch.isfinite(got).all()
    error = float((got.float() - want.float()).norm() / want.float().norm())
    assert error <= (1e-5 if dtype == torch.float32 else 2e-2), error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_cuda_graph_of_the_grouped_gemm_replays_new_counts_and_layers() -> None:
    """Captured once, replayed after writing new counts and a new layer index into the
    device tensors the graph reads: equal to eager calls with those values (the FFN loop's
    graph mode needs exactly this: no host read, no weight copy)."""
    from afd_models import triton_grouped_gemm as tgg

    gen = torch.Generator(device="cuda").manual_seed(5)
    layers, local, n_out, k_in, rows = 3, 4, 256, 512, 300
    w = torch.randn(layers, local, n_out, k_in, generator=gen, device="cuda").to(torch.bfloat16)
    x = torch.randn(rows, k_in, generator=gen, device="cuda").to(torch.bfloat16)
    counts = torch.tensor([100, 0, 150, 50], device="cuda")
    layer = torch.zeros(1, dtype=torch.int32, device="cuda")
    tgg.grouped_gemm(x, w, counts, layer)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tgg.grouped_gemm(x, w, counts, layer)
    for new_counts, new_layer in (([0, 300, 0, 0], 2), ([75, 75, 75, 75], 1)):
        counts.copy_(torch.tensor(new_counts))
        layer.fill_(new_layer)
        graph.replay()
        eager = tgg.grouped_gemm(x, w, counts, layer)
        assert torch.equal(captured, eager)
        start = 0
        for e, n in enumerate(new_counts):
            want = x[start : start + n].float() @ w[new_layer, e].float().T
            got = captured[start : start + n].float()
            if n:
                assert float((got - want).norm() / want.norm()) <= 1e-2
            start += n


def test_graph_buckets_need_the_triton_backend_and_sane_sizes() -> None:
    pytest.importorskip("triton")
    from afd_models import ConfigError, FFNRoleExecutor, preset

    config = preset("tiny")
    with pytest.raises(ConfigError, match="graph_buckets runs the triton backend's kernels"):
        FFNRoleExecutor(config, range(4), graph_buckets=(16,))
    with pytest.raises(ConfigError, match="graph buckets must be row counts >= 1"):
        FFNRoleExecutor(config, range(4), backend="triton", graph_buckets=(0, 16))


def test_a_device_expert_step_needs_the_triton_backend_and_attention_shared_experts() -> None:
    from afd_models import ConfigError, FFNRoleExecutor, preset

    config = preset("tiny")
    with pytest.raises(ConfigError, match="build the executor with backend='triton'"):
        FFNRoleExecutor(config, range(4)).device_expert_step()
    shared_here = FFNRoleExecutor(config, range(4), backend="triton", shared_placement="ffn")
    with pytest.raises(ConfigError, match="computes routed experts only"):
        shared_here.device_expert_step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_graph_replays_equal_eager_steps_for_every_layer_and_size() -> None:
    """FFNRoleExecutor with graph buckets on CUDA: the captured step, replayed for each
    layer and item size (a large item, then smaller ones over its stale rows, one beyond
    every bucket), equals the eager triton step bit for bit."""
    from afd_models import FFNRoleExecutor, RandomWeights, preset
    from afd_models.graphed_experts import GraphedExperts

    config = preset("v2-lite", num_layers=3)
    executor = FFNRoleExecutor(
        config,
        range(16),
        RandomWeights(0),
        dtype=torch.bfloat16,
        device="cuda",
        backend="triton",
        graph_buckets=(256, 2048),
    )
    graphed = executor.graphed
    assert graphed is not None
    assert graphed.capture
    eager = GraphedExperts(executor.stack, graphed.buckets, capture=False)
    gen = torch.Generator(device="cuda").manual_seed(4)
    for n in (2000, 37, 256, 3000):
        ids = torch.randint(0, 16, (n,), generator=gen, device="cuda")
        counts = torch.bincount(ids, minlength=16)
        rows = torch.randn(n, config.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        work = GroupedRows(rows, counts)
        for layer in config.moe_layers:
            assert torch.equal(graphed(layer, work), eager(layer, work)), (n, layer)
