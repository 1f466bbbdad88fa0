"""The same model on an NVIDIA GPU: equal to the CPU model; grouped_mm on the device.

Skipped without CUDA (the CPU CI machine); run on a GPU host with
``python -m pytest -m gpu packages/afd-models/tests``.
"""

from __future__ import annotations

from typing import Any

import afd_models_naive as naive
import pytest
import torch
from torch.nn import functional
from torch.overrides import TorchFunctionMode

from afd_models import (
    BackendUnavailable,
    ExpertWeights,
    GroupedRows,
    KVCache,
    MonolithicModel,
    PromptChunk,
    RandomWeights,
    get_expert_backend,
)
from afd_models import preset as make_preset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

PROMPTS = [[(5 * i + 1) % 512 for i in range(n)] for n in (37, 5, 80)]


@pytest.mark.parametrize(
    ("name", "dtype", "tolerance"),
    [
        ("tiny", torch.float32, 1e-4),
        ("v3-mini", torch.float32, 1e-4),
        # bf16 only with softmax routing: CPU and GPU kernels round differently, and the
        # toy V3 router (sigmoid + bias over 16 experts) has near-ties that such rounding
        # flips, which moves whole expert outputs -- not a property either device claims.
        ("tiny", torch.bfloat16, 3e-2),
    ],
)
def test_cuda_model_matches_cpu(name: str, dtype: torch.dtype, tolerance: float) -> None:
    config = make_preset(name)
    cpu = MonolithicModel(config, RandomWeights(3), dtype=dtype).forward(PROMPTS)
    for backend in ("reference", "grouped_mm"):
        try:
            gpu_model = MonolithicModel(
                config, RandomWeights(3), dtype=dtype, device="cuda", backend=backend
            )
            gpu = gpu_model.forward(PROMPTS, num_stages=2)
        except BackendUnavailable:
            assert backend == "grouped_mm"
            continue
        assert gpu.hidden_states.device.type == "cuda"
        assert naive.relative_error(gpu.hidden_states, cpu.hidden_states) <= tolerance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mm_on_cuda_agrees_with_reference_or_says_why(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter = 8, 256, 128
    weights = ExpertWeights(
        0,
        tuple(range(experts)),
        (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to("cuda", dtype),
        (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to("cuda", dtype),
    )
    counts = torch.tensor([5, 0, 17, 1, 0, 33, 2, 9])
    rows = torch.randn(int(counts.sum()), hidden, generator=gen).to("cuda", dtype)
    work = GroupedRows(rows, counts)
    reference = get_expert_backend("reference")(work, weights)
    try:
        out = get_expert_backend("grouped_mm")(work, weights)
    except BackendUnavailable as exc:
        unavailable = str(exc)
    else:
        unavailable = ""
    if unavailable:  # allowed only off bf16, and the message must say what to use instead
        assert dtype != torch.bfloat16, f"grouped_mm must run bf16 on CUDA: {unavailable}"
        assert "reference" in unavailable
        return
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert naive.relative_error(out, reference) <= tolerance


def _cudnn_sdp_enabled() -> bool:
    return bool(torch.backends.cuda.cudnn_sdp_enabled())  # type: ignore[no-untyped-call]


def test_attention_never_lets_cudnn_plan_per_length() -> None:
    """cuDNN's SDPA builds a plan per sequence length (48 ms on an H200 for each new
    prompt length, docs/benchmarks.md), so the model runs attention with it disabled: every
    call, of any length, with or without a cache, sees cuDNN off."""
    seen: list[tuple[int, bool]] = []

    class Recording(TorchFunctionMode):
        """Sees every SDPA call before its arguments' own overrides (a causal bias
        dispatches itself there, so patching the function would bypass it)."""

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func is functional.scaled_dot_product_attention:
                seen.append((args[0].shape[-2], _cudnn_sdp_enabled()))
            return func(*args, **(kwargs or {}))

    config = make_preset("v3-mini")
    model = MonolithicModel(config, RandomWeights(3), dtype=torch.bfloat16, device="cuda")
    before = _cudnn_sdp_enabled()
    with Recording():
        model.forward(PROMPTS)
        assert {n for n, _ in seen} >= {37, 5, 80}
        model.forward(PROMPTS, num_stages=2)  # stage 2 attends through the cache (a mask)
    assert not any(enabled for _, enabled in seen), seen
    assert _cudnn_sdp_enabled() == before  # the setting is scoped to the call


@pytest.mark.parametrize("name", ["tiny", "v3-mini"])
def test_later_pieces_attend_on_cuda_as_the_whole_prompt_does(name: str) -> None:
    """A piece that starts mid-prompt (a later stage or chunk) attends through the cache
    with the lower-right causal mask, which the GPU's fused kernel applies itself (skipping
    the tiles it masks whole): in float32 the pieces give the whole prompt's hidden states
    at every position, for pieces that start on a 64-row tile boundary and off one."""
    config = make_preset(name)
    model = MonolithicModel(config, RandomWeights(3), dtype=torch.float32, device="cuda")
    tokens = [(7 * i + 3) % config.vocab_size for i in range(300)]
    whole = model.forward([tokens], compute_logits=False).hidden_states
    cache = KVCache()
    pieces = []
    for begin, end in ((0, 64), (64, 157), (157, 300)):
        step = [PromptChunk("p", tokens[begin:end], begin, end == len(tokens))]
        pieces.append(model.forward(step, cache=cache, compute_logits=False).hidden_states)
    assert len(cache) == 0
    chunked = torch.cat(pieces)
    assert torch.isfinite(chunked).all()
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
