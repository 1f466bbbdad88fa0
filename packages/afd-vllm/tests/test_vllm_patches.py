"""afd-vllm's patch applied to the real vLLM functions (``EngineArgs.create_model_config``
and ``create_engine_config``), in-process on vLLM's CPU platform: what an attention-role
engine is configured as, and every refusal with its message. Runs in the vLLM venv
(``make vllm-engine``); skipped where vLLM is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

import vllm_engine_support as support  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

import afd_vllm  # noqa: E402
from afd_vllm.extra import AFDConfigError  # noqa: E402
from afd_vllm.ops import SPLITTING_OPS  # noqa: E402
from afd_vllm.tiny_model import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    afd_vllm.register_afd()
    return write_tiny_model(tmp_path_factory.mktemp("model"))


def _afd(role: str = "attention", ranks: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        "afd": {
            "role": role,
            "connector": "HostAsyncAFDConnector",
            "num_attention_ranks": ranks,
            "connector_extra_config": {"rendezvous_dir": "/tmp/unused", **extra},
        }
    }


def _engine_config(model: Path, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": support.MAX_MODEL_LEN,
        "max_num_batched_tokens": support.BATCHED_TOKENS,
        "attention_backend": "CPU_MLA",
        "data_parallel_size": 2,
    }
    settings.update(kwargs)
    return EngineArgs(**settings).create_engine_config()


def test_without_afd_config_vllm_is_untouched(model: Path) -> None:
    config = _engine_config(model, data_parallel_size=1)
    assert config.model_config.architectures == ["DeepseekV2ForCausalLM"]
    assert config.model_config.is_moe
    assert config.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"


def test_attention_role_engine_is_afds_model_and_worker_without_local_experts(
    model: Path,
) -> None:
    config = _engine_config(model, additional_config=_afd())
    assert config.model_config.architectures == ["AFDDeepseekV2ForCausalLM"]
    assert not config.model_config.is_moe  # so vLLM runs each DP rank on its own
    assert config.model_config.hf_config.n_routed_experts == 8  # the router still needs it
    assert config.parallel_config.worker_cls == "afd_vllm.worker.AFDCPUWorker"
    splitting = config.compilation_config.splitting_ops
    assert not splitting or set(SPLITTING_OPS) <= set(splitting)


def test_user_hf_overrides_are_kept(model: Path) -> None:
    config = _engine_config(model, additional_config=_afd(), hf_overrides={"rms_norm_eps": 2e-6})
    assert config.model_config.hf_config.rms_norm_eps == 2e-6
    assert config.model_config.architectures == ["AFDDeepseekV2ForCausalLM"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enforce_eager": True}, "eager mode (--enforce-eager) is refused"),
        ({"data_parallel_size": 1}, "afd.num_attention_ranks is 2 but this deployment has 1"),
        ({"dtype": "float16"}, "runs in float32 or bfloat16"),
        ({"hf_overrides": lambda c: c}, "pass hf_overrides as a JSON object"),
        ({"additional_config": _afd(role="ffn")}, "start the FFN role with `afd-vllm ffn"),
        ({"additional_config": _afd(attn_ranks_per_dp=2)}, "tensor_parallel_size must be 1"),
        ({"additional_config": _afd(async_moe_ubatching=True)}, "async_moe_ubatching"),
    ],
    ids=["eager", "rank-count", "float16", "hf-overrides-callable", "ffn-role", "tp", "ubatch"],
)
def test_unsupported_settings_are_refused_with_what_to_change(
    model: Path, kwargs: dict[str, Any], message: str
) -> None:
    kwargs.setdefault("additional_config", _afd())
    with pytest.raises(AFDConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _engine_config(model, **kwargs)


def test_unsupported_vllm_version_is_one_line(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(AFDConfigError) as raised:
        _engine_config(model, additional_config=_afd())
    assert str(raised.value) == "afd-vllm supports vLLM 0.32.x or 0.33.x; found vLLM 0.31.2"


def test_registration_is_idempotent(model: Path) -> None:
    afd_vllm.register_afd()
    from afd_vllm import vllm_compat

    vllm_compat.install()
    wrapped = EngineArgs.create_engine_config
    assert not hasattr(wrapped.__wrapped__, "__wrapped__")  # wrapped exactly once
    assert not hasattr(EngineArgs.create_model_config.__wrapped__, "__wrapped__")


def test_shutdown_gets_a_grace_period_unless_the_user_chose_one(model: Path) -> None:
    from afd_vllm.vllm_compat import SHUTDOWN_GRACE_S

    assert _engine_config(model, additional_config=_afd()).shutdown_timeout == SHUTDOWN_GRACE_S
    chosen = _engine_config(model, additional_config=_afd(), shutdown_timeout=3)
    assert chosen.shutdown_timeout == 3


def test_full_cuda_graphs_are_refused(model: Path) -> None:
    """On a GPU, vLLM's default captures whole forwards, which would freeze afd's host-side
    dispatch into a graph; the CPU platform never does, so set the mode by hand."""
    from vllm.config import CUDAGraphMode

    from afd_vllm.config import parse_afd_config
    from afd_vllm.vllm_compat import refuse_unsupported

    config = _engine_config(model, additional_config=_afd())
    afd = parse_afd_config(_afd())
    assert afd is not None
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    with pytest.raises(AFDConfigError, match='"cudagraph_mode": "PIECEWISE"'):
        refuse_unsupported(config, afd)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    refuse_unsupported(config, afd)


def test_both_of_vllms_workers_map_to_afds(model: Path) -> None:
    from afd_vllm import vllm_compat, worker

    config = _engine_config(model, additional_config=_afd())
    config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"
    vllm_compat._swap_worker(config)
    assert config.parallel_config.worker_cls == "afd_vllm.worker.AFDGPUWorker"
    assert issubclass(worker.AFDGPUWorker, worker.AFDWorkerMixin)
    config.parallel_config.worker_cls = "my.Worker"
    with pytest.raises(AFDConfigError, match="leave --worker-cls unset"):
        vllm_compat._swap_worker(config)


def test_remote_moe_is_built_and_called_like_vllms_moe() -> None:
    """vLLM's decoder layer builds and calls ``DeepseekV2MoE`` by name; the rebinding only
    works while afd's block takes the same arguments (checked per vLLM version)."""
    import inspect

    from vllm.model_executor.models import deepseek_v2

    from afd_vllm.model import AFDRemoteMoE

    for method in ("__init__", "forward"):
        theirs = inspect.signature(getattr(deepseek_v2.DeepseekV2MoE, method)).parameters
        ours = inspect.signature(getattr(AFDRemoteMoE, method)).parameters
        assert list(ours) == list(theirs), method


def test_the_worker_classes_build_on_this_vllm() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from afd_vllm.worker import AFDCPUWorker, AFDGPUWorker

    assert issubclass(AFDCPUWorker, CPUWorker)
    assert issubclass(AFDGPUWorker, Worker)
    assert AFDCPUWorker.load_model is not CPUWorker.load_model
