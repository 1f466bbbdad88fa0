"""The one place afd-vllm changes vLLM's behaviour: how an attention-role engine is
configured. Inert unless ``additional_config`` has an ``"afd"`` entry.

An attention-role engine serves DeepSeek-V2/V3 without its routed experts, so it is
presented to vLLM as what it is locally, a model with no experts: vLLM then runs each
data-parallel rank as an independent engine (``EngineCoreProc``, no DP waves, no dummy
batches, no per-step all-reduce; inside the worker DP = 1), which is exactly afd's
asynchronous replicas. vLLM makes that choice in the launching process from
``model_config.is_moe``, so the change travels inside the ``VllmConfig`` it pickles to
the engine cores; nothing is patched inside the engine loop or the model runner.

The patch wraps two ``EngineArgs`` methods:

* ``create_model_config``: the model's architecture-level expert count reads 0
  (``model_arch_config.num_experts``, what ``is_moe`` reads), while ``hf_config`` keeps
  its expert fields (the router needs them);
* ``create_engine_config``: before, the architecture is rewritten to afd's
  (``AFDDeepseekV2ForCausalLM``: MoE blocks dispatch to the FFN ranks) and the vLLM
  version checked; after, vLLM's worker is swapped for afd's (it connects to the FFN
  ranks once the model is loaded), every unsupported feature is refused with one
  message naming it, and a zero ``shutdown_timeout`` gets a few seconds of grace (so
  workers can tell the FFN ranks they are done).

It goes away when vLLM offers a hook to declare a model's experts remote.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from afd_vllm import check_vllm_version
from afd_vllm.attention_session import DTYPE_NAMES
from afd_vllm.config import AFDConfig, parse_afd_config
from afd_vllm.extra import AFDConfigError
from afd_vllm.ops import SPLITTING_OPS

WORKERS = {
    "vllm.v1.worker.cpu_worker.CPUWorker": "afd_vllm.worker.AFDCPUWorker",
    "vllm.v1.worker.gpu_worker.Worker": "afd_vllm.worker.AFDGPUWorker",
}
"""vLLM's worker class -> afd's attention worker built on it (the GPU one is unverified on
a GPU vLLM; see the package README)."""

_installed = False


class AFDArchitecture:
    """``hf_overrides`` callable: the user's overrides, then the architecture rewritten to
    afd's attention-role class. A class, not a closure, so the config pickles."""

    def __init__(self, user_overrides: Mapping[str, Any] | None = None) -> None:
        self.user_overrides = dict(user_overrides or {})

    def __call__(self, hf_config: Any) -> Any:
        from afd_vllm.model import ARCHITECTURES

        for key, value in self.user_overrides.items():
            setattr(hf_config, key, value)
        found = list(getattr(hf_config, "architectures", None) or [])
        known = [a for a in found if a in ARCHITECTURES]
        if known:  # vLLM also probes with a dummy config: leave anything else alone
            hf_config.architectures = [ARCHITECTURES[known[0]]]
        return hf_config


def _attention_config(engine_args: Any) -> AFDConfig | None:
    config = parse_afd_config(engine_args.additional_config)
    if config is None:
        return None
    if not config.is_attention:
        raise AFDConfigError(
            'afd.role "ffn" does not run as a vLLM engine: start the FFN role with '
            "`afd-vllm ffn --model DIR --additional-config ...` (see afd-vllm's README)"
        )
    return config


def refuse_unsupported(vllm_config: Any, afd: AFDConfig) -> None:
    """One :class:`AFDConfigError` for the first feature afd's attention role cannot run."""
    parallel = vllm_config.parallel_config
    compilation = vllm_config.compilation_config
    problems = {
        "pipeline_parallel_size must be 1": parallel.pipeline_parallel_size != 1,
        "tensor_parallel_size must be 1 (afd.connector_extra_config.attn_ranks_per_dp = 1 "
        "for now)": parallel.tensor_parallel_size != 1 or afd.extra.attn_ranks_per_dp != 1,
        "--enable-expert-parallel has no experts to spread here (they are on the FFN ranks)": (
            parallel.enable_expert_parallel
        ),
        "--enable-eplb: the FFN ranks own expert placement": parallel.enable_eplb,
        "dual-batch overlap (--enable-dbo): afd overlaps through its own stages": getattr(
            parallel, "enable_dbo", False
        ),
        "speculative decoding": vllm_config.speculative_config is not None,
        "connector_extra_config.async_moe_ubatching (token-level stages run in `afd run "
        "--stages N`, not yet inside vLLM)": afd.extra.async_moe_ubatching,
    }
    for problem, present in problems.items():
        if present:
            raise AFDConfigError(f"afd-vllm's attention role does not support this: {problem}")
    ranks = parallel.data_parallel_size * parallel.tensor_parallel_size
    if ranks != afd.num_attention_ranks:
        raise AFDConfigError(
            f"afd.num_attention_ranks is {afd.num_attention_ranks} but this deployment has "
            f"{ranks} attention workers (data_parallel_size x tensor_parallel_size); make "
            f"them equal"
        )
    dtype = str(vllm_config.model_config.dtype)
    if dtype not in DTYPE_NAMES:
        raise AFDConfigError(
            f"afd-vllm's attention role runs in float32 or bfloat16, not {dtype}; pass "
            f"--dtype bfloat16 or --dtype float32"
        )
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    full_graphs = (
        compilation.cudagraph_mode is not None and compilation.cudagraph_mode.has_full_cudagraphs()
    )
    if full_graphs:
        raise AFDConfigError(
            f"cudagraph_mode {compilation.cudagraph_mode.name} captures whole forwards, and "
            f"afd's dispatch/combine cannot be replayed from a graph yet; pass "
            f'--compilation-config \'{{"cudagraph_mode": "PIECEWISE"}}\''
        )
    if current_platform.is_cpu() and compilation.mode == CompilationMode.NONE:
        raise AFDConfigError(
            "eager mode (--enforce-eager) is refused on vLLM's CPU platform: its rotary "
            "kernel mis-rotates DeepSeek's 3-D query there (wrong outputs, also without "
            "afd); run compiled (the default)"
        )


def _swap_worker(vllm_config: Any) -> None:
    parallel = vllm_config.parallel_config
    afd_worker = WORKERS.get(parallel.worker_cls)
    if afd_worker is None:
        raise AFDConfigError(
            f"afd-vllm's attention role runs on {sorted(WORKERS)}; this engine resolved "
            f"worker_cls {parallel.worker_cls!r} (leave --worker-cls unset)"
        )
    parallel.worker_cls = afd_worker


SHUTDOWN_GRACE_S = 10
"""What ``--shutdown-timeout 0`` (vLLM's default) becomes for an attention-role engine."""


def _graceful_shutdown(vllm_config: Any) -> None:
    """Give the workers time to tell the FFN ranks they are done.

    With ``shutdown_timeout`` 0 vLLM kills every engine process tree the moment it stops
    (Ctrl-C included), so a worker cannot announce its shutdown and the FFN ranks report
    the attention rank as lost. A few seconds let each worker close its connection; a
    value the user chose above 0 is kept."""
    if vllm_config.shutdown_timeout == 0:
        vllm_config.shutdown_timeout = SHUTDOWN_GRACE_S


def _add_splitting_ops(vllm_config: Any) -> None:
    """Dispatch and combine split compiled graphs where vLLM splits them (CUDA graphs are
    captured between them); where the whole graph is compiled they stay opaque nodes."""
    ops = vllm_config.compilation_config.splitting_ops
    if ops:
        ops.extend(op for op in SPLITTING_OPS if op not in ops)


def _no_local_experts(model_config: Any) -> Any:
    arch = model_config.model_arch_config
    model_config.model_arch_config = dataclasses.replace(arch, num_experts=0)
    return model_config


def _wrap_create_model_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_model_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        model_config = original(self, *args, **kwargs)
        if _attention_config(self) is None:
            return model_config
        from afd_vllm.model import ARCHITECTURES

        if not set(model_config.architectures) & set(ARCHITECTURES.values()):
            raise AFDConfigError(
                f"afd-vllm's attention role serves {sorted(ARCHITECTURES)}; this model's "
                f"config.json names {list(model_config.architectures)}"
            )
        return _no_local_experts(model_config)

    return create_model_config


def _wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        afd = _attention_config(self)
        if afd is None:
            return original(self, *args, **kwargs)
        import vllm

        from afd_vllm.model import register_models

        check_vllm_version(vllm.__version__)
        register_models()
        if callable(self.hf_overrides) and not isinstance(self.hf_overrides, AFDArchitecture):
            raise AFDConfigError(
                "afd-vllm rewrites the architecture through hf_overrides; pass hf_overrides "
                "as a JSON object, not a function"
            )
        if not isinstance(self.hf_overrides, AFDArchitecture):
            self.hf_overrides = AFDArchitecture(self.hf_overrides)
        vllm_config = original(self, *args, **kwargs)
        refuse_unsupported(vllm_config, afd)
        _swap_worker(vllm_config)
        _add_splitting_ops(vllm_config)
        _graceful_shutdown(vllm_config)
        return vllm_config

    return create_engine_config


def install() -> None:
    """Apply the patch once per process (called by :func:`afd_vllm.register_afd`)."""
    global _installed
    if _installed:
        return
    from vllm.engine.arg_utils import EngineArgs

    # ### PATCH START: afd attention-role engines (see the module docstring)
    EngineArgs.create_model_config = _wrap_create_model_config(EngineArgs.create_model_config)
    EngineArgs.create_engine_config = _wrap_create_engine_config(EngineArgs.create_engine_config)
    # ### PATCH END
    _installed = True
