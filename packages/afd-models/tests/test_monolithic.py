"""The monolithic reference model against the naive whole-model reference."""

from __future__ import annotations

import afd_models_naive as naive
import pytest
import torch

from afd_models import MonolithicModel, RandomWeights
from afd_models import preset as make_preset

PROMPTS = [[5, 17, 300, 2, 9, 44, 101], [3], [250, 251, 252, 7, 8, 1, 0, 511, 42, 77, 19]]


@pytest.mark.parametrize("name", ["tiny", "v3-mini"])
def test_matches_naive_whole_model(name: str) -> None:
    config = make_preset(name)
    model = MonolithicModel(config, RandomWeights(9))
    out = model.forward(PROMPTS)
    hidden, logits = naive.forward(config, model.tensors(), PROMPTS)
    assert out.hidden_states.shape == (sum(map(len, PROMPTS)), config.hidden_size)
    assert naive.relative_error(out.hidden_states, hidden) <= 1e-5
    assert out.logits is not None
    assert out.logits.dtype == torch.float32
    assert naive.relative_error(out.logits, logits) <= 1e-5
    assert [t.shape[0] for t in out.per_prompt()] == list(map(len, PROMPTS))
    torch.testing.assert_close(out.last_hidden_states()[1], out.hidden_states[7])


@pytest.mark.parametrize("name", ["tiny", "v3-mini"])
def test_stages_and_backends_do_not_change_the_result(name: str) -> None:
    config = make_preset(name)
    ref = MonolithicModel(config, RandomWeights(9)).forward(PROMPTS)
    grouped = MonolithicModel(config, RandomWeights(9), backend="grouped_mm")
    for stages in (1, 2, 5):
        out = grouped.forward(PROMPTS, num_stages=stages)
        assert naive.relative_error(out.hidden_states, ref.hidden_states) <= 1e-5


def test_prompts_do_not_see_each_other() -> None:
    model = MonolithicModel(make_preset("tiny"), RandomWeights(9))
    together = model.forward(PROMPTS).per_prompt()
    for prompt, joint in zip(PROMPTS, together, strict=True):
        alone = model.forward([prompt]).hidden_states
        assert naive.relative_error(joint, alone) <= 1e-5


def test_bfloat16_runs_and_stays_close() -> None:
    config = make_preset("tiny")
    ref = MonolithicModel(config, RandomWeights(9)).forward(PROMPTS).hidden_states
    out = MonolithicModel(config, RandomWeights(9), dtype=torch.bfloat16).forward(PROMPTS)
    assert out.hidden_states.dtype == torch.bfloat16
    assert naive.relative_error(out.hidden_states, ref) <= 5e-2
