"""What an attention worker connects with, read from vLLM's configuration (no vLLM needed:
``session_settings`` reads plain attributes), and the connection it opens and closes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from afd_vllm.attention_session import session_settings
from afd_vllm.extra import AFDConfigError


def _vllm_config(
    dp_index: int = 0, tp: int = 1, ranks: int = 2, dtype: str = "torch.float32"
) -> Any:
    hf = SimpleNamespace(
        hidden_size=64, n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=3
    )
    return SimpleNamespace(
        additional_config={
            "afd": {
                "role": "attention",
                "connector": "HostAsyncAFDConnector",
                "num_attention_ranks": ranks,
                "connector_extra_config": {"rendezvous_dir": "/tmp/unused"},
            }
        },
        model_config=SimpleNamespace(hf_config=hf, dtype=dtype),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048),
        parallel_config=SimpleNamespace(data_parallel_index=dp_index, tensor_parallel_size=tp),
    )


def test_settings_carry_the_geometry_and_the_rank() -> None:
    settings = session_settings(_vllm_config(dp_index=1))
    assert settings.rank == 1
    geometry = settings.geometry
    assert (geometry.hidden_size, geometry.num_experts, geometry.topk) == (64, 8, 2)
    assert (geometry.num_layers, geometry.max_num_batched_tokens) == (3, 2048)
    assert geometry.dtype == "float32"
    assert session_settings(_vllm_config(dp_index=1, tp=2, ranks=4), tp_rank=1).rank == 3


def test_a_rank_past_num_attention_ranks_says_what_to_set() -> None:
    with pytest.raises(AFDConfigError, match=r"attention rank 2 but afd\.num_attention_ranks is 2"):
        session_settings(_vllm_config(dp_index=2))


def test_float16_is_refused() -> None:
    with pytest.raises(AFDConfigError, match=r"float32 or bfloat16, not torch\.float16"):
        session_settings(_vllm_config(dtype="torch.float16"))


def test_an_engine_without_afd_config_is_refused() -> None:
    config = _vllm_config()
    config.additional_config = {}
    with pytest.raises(AFDConfigError, match='without an "afd" additional_config'):
        session_settings(config)
