"""Norm, YaRN rotary, MLA attention and the batch/stage split against naive references."""

from __future__ import annotations

import itertools
import math

import afd_models_naive as naive
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_models import (
    ConfigError,
    KVCache,
    MonolithicModel,
    PromptBatch,
    PromptChunk,
    RandomWeights,
    RMSNorm,
    RotaryEmbedding,
    stage_count,
)
from afd_models import preset as make_preset
from afd_models.rotary import inverse_frequencies


def test_rms_norm_matches_naive() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=gen), torch.randn(32, generator=gen)
    out = RMSNorm(w, 1e-6)(x)
    for t in range(5):
        torch.testing.assert_close(
            out[t].double(), naive.rms_norm(x[t].double(), w.double(), 1e-6), rtol=1e-6, atol=1e-6
        )
    assert RMSNorm(w.bfloat16(), 1e-6)(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["tiny", "v3-mini", "v2-lite"])
def test_yarn_frequencies_match_naive(name: str) -> None:
    config = make_preset(name)
    inv_freq, mscale = inverse_frequencies(
        config.qk_rope_head_dim, config.rope_theta, config.rope_scaling
    )
    expected = [naive.inverse_frequency(config, i) for i in range(config.qk_rope_head_dim // 2)]
    torch.testing.assert_close(
        inv_freq.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert mscale == pytest.approx(1.0)  # mscale == mscale_all_dim in these presets
    # YaRN really interpolates: the slowest frequencies are divided by the factor.
    assert config.rope_scaling is not None
    base = config.rope_theta ** (-(config.qk_rope_head_dim - 2) / config.qk_rope_head_dim)
    assert inv_freq[-1].item() == pytest.approx(base / config.rope_scaling.factor, rel=1e-5)
    assert config.softmax_scale > config.qk_head_dim**-0.5


def test_rotary_rotates_interleaved_pairs() -> None:
    config = make_preset("tiny")
    rope = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, config.qk_rope_head_dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095])
    out = rope(x, *rope.cos_sin(positions))
    for t, p in enumerate(positions.tolist()):
        # Angles are float32 (as in the reference): at position p they are good to ~p * 1e-7.
        tolerance = 1e-5 if p < 128 else 2e-3
        for h in range(2):
            torch.testing.assert_close(
                out[t, h].double(),
                naive.rotate(config, x[t, h].double(), p),
                rtol=tolerance,
                atol=tolerance,
            )
    # Rotation keeps norms (mscale is 1 here) and position 0 is the identity.
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], x[0])
    neox = RotaryEmbedding(
        config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, interleaved=False
    )
    assert not torch.allclose(neox(x, *neox.cos_sin(positions)), out)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6), stages=st.integers(1, 8))
def test_stages_cover_every_token_once(lengths: list[int], stages: int) -> None:
    batch = PromptBatch.from_prompts([[0] * n for n in lengths])
    cut = batch.stages(stages)
    total = sum(lengths)
    assert 1 <= len(cut) <= min(stages, total)
    assert cut[0].begin == 0
    assert cut[-1].end == total
    sizes = [s.num_tokens for s in cut]
    assert max(sizes) - min(sizes) <= 1  # balanced
    seen = []
    for stage, following in itertools.pairwise(cut):
        assert stage.end == following.begin
    offsets = batch.offsets
    for stage in cut:
        rows = 0
        for seg in stage.segments:
            assert seg.row == rows
            rows += seg.length
            first = offsets[seg.request] + seg.start
            assert first == stage.begin + seg.row
            assert seg.ends_request == (seg.start + seg.length == lengths[seg.request])
            seen.extend(range(first, first + seg.length))
        assert rows == stage.num_tokens
    assert seen == list(range(total))
    assert batch.positions().tolist() == [p for n in lengths for p in range(n)]


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    stages=st.integers(1, 8),
    floor=st.integers(0, 60),
)
def test_a_stage_floor_cuts_small_batches_into_fewer_stages(
    lengths: list[int], stages: int, floor: int
) -> None:
    """``min_stage_tokens``: no stage below the floor unless the whole batch is (then one
    stage), never more stages than asked, and the cut is the plain cut at that count."""
    batch = PromptBatch.from_prompts([[0] * n for n in lengths])
    total = sum(lengths)
    cut = batch.stages(stages, floor)
    expected = stages if floor == 0 else max(1, min(stages, total // floor))
    assert stage_count(total, stages, floor) == expected
    assert len(cut) == min(expected, total)
    assert cut == batch.stages(expected)
    if len(cut) > 1:
        assert min(s.num_tokens for s in cut) >= floor


def test_the_stage_floor_of_the_measured_case() -> None:
    """1,024 tokens, two stages asked: a floor of 2,048 keeps one, 512 keeps both."""
    assert stage_count(1024, 2, 2048) == 1
    assert stage_count(1024, 2, 512) == 2
    assert stage_count(8192, 4, 2048) == 4
    assert stage_count(8191, 4, 2048) == 3
    with pytest.raises(ConfigError, match="min_stage_tokens must be >= 0, got -1"):
        stage_count(10, 2, -1)


def test_batch_rejects_empty_prompts() -> None:
    with pytest.raises(ConfigError, match="empty"):
        PromptBatch.from_prompts([[1], []])
    with pytest.raises(ConfigError, match="at least one prompt"):
        PromptBatch.from_prompts([])
    with pytest.raises(ConfigError, match="num_stages"):
        PromptBatch.from_prompts([[1]]).stages(0)


@pytest.mark.parametrize("name", ["tiny", "v3-mini"])
@pytest.mark.parametrize("stages", [1, 4])
def test_mla_attention_matches_naive_per_request(name: str, stages: int) -> None:
    """Causal within each request, nothing across requests, chunked or not."""
    model = MonolithicModel(make_preset(name), RandomWeights(4))
    config = model.config
    lengths = [5, 9, 2]
    batch = PromptBatch.from_prompts([[0] * n for n in lengths])
    x = torch.randn(sum(lengths), config.hidden_size, generator=torch.Generator().manual_seed(2))
    attention = model.trunk.layers[1].attention
    positions = batch.positions()
    cache = KVCache()
    with torch.inference_mode():
        out = torch.cat(
            [
                attention(x[s.begin : s.end], positions[s.begin : s.end], s.segments, cache)
                for s in batch.stages(stages)
            ]
        )
    assert len(cache) == 0  # nothing left behind once every request is finished
    weights = model.tensors()
    expected = torch.cat(
        [naive.attention_request(config, weights, 1, chunk.double()) for chunk in x.split(lengths)]
    )
    assert naive.relative_error(out, expected) <= 1e-5


def test_kv_cache_demands_stage_order() -> None:
    batch = PromptBatch.from_prompts([[0] * 10])
    late = batch.stages(2)[1].segments[0]
    with pytest.raises(ConfigError, match="in order"):
        KVCache().extend(0, late, torch.zeros(5, 4), torch.zeros(5, 2))


def test_chunks_carry_their_positions_and_only_the_final_one_ends_the_request() -> None:
    batch = PromptBatch.from_prompts(
        [PromptChunk("a", [1, 2, 3], start=4, final=False), [7, 8], PromptChunk("b", [5], 9)]
    )
    assert batch.positions().tolist() == [4, 5, 6, 0, 1, 9]
    (stage,) = batch.stages(1)
    assert [(s.key, s.start, s.ends_request) for s in stage.segments] == [
        ("a", 4, False),
        (("batch entry", 1), 0, True),
        ("b", 9, True),
    ]
    with pytest.raises(ConfigError, match="two chunks of one request"):
        PromptBatch.from_prompts([PromptChunk("a", [1]), PromptChunk("a", [2], 1)])


def test_softmax_scale_uses_mscale_all_dim() -> None:
    config = make_preset("v2-lite")
    m = 0.1 * 0.707 * math.log(40) + 1.0
    assert config.softmax_scale == pytest.approx(192**-0.5 * m * m)
