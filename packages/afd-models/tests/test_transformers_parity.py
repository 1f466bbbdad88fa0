"""Parity with Hugging Face transformers' DeepseekV2/V3ForCausalLM on the same checkpoint.

Skipped where transformers is not installed (the CPU CI machine does not install it; the
GPU image does). It checks what no in-house reference can: that our parameter names,
rotary layout, YaRN, MLA and routing are those of the canonical implementation.
"""

from __future__ import annotations

import afd_models_naive as naive
import pytest
import torch

from afd_models import MonolithicModel, RandomWeights, materialize, save_checkpoint
from afd_models import preset as make_preset

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 3) % 512 for i in range(n)] for n in (9, 21, 4)]


@pytest.mark.parametrize("name", ["tiny", "v3-mini"])
def test_matches_transformers(tmp_path, name: str) -> None:
    config = make_preset(name)
    save_checkpoint(tmp_path, config, materialize(config, RandomWeights(0)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    ours = MonolithicModel(config, RandomWeights(0)).forward(PROMPTS)
    assert ours.logits is not None
    for i, (prompt, hidden) in enumerate(zip(PROMPTS, ours.per_prompt(), strict=True)):
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
        assert naive.relative_error(hidden, out.hidden_states[-1][0]) <= 1e-5
        assert naive.relative_error(ours.logits[i], out.logits[0, -1]) <= 1e-5
