"""The attention role's vLLM worker: vLLM's own worker, plus afd's connection.

After vLLM loaded the model (:class:`~afd_vllm.model.AFDDeepseekV2ForCausalLM`) the worker
connects as its attention rank and binds the endpoint to the dispatch/combine operators,
so vLLM's warm-up and every later forward reach the FFN ranks; at shutdown it announces
the end to the FFN ranks and releases the connection. :mod:`afd_vllm.vllm_compat` selects
these classes (``parallel_config.worker_cls``) for attention-role engines.

Import this module only inside vLLM (it imports vLLM's worker classes).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from afd_vllm.attention_session import AttentionSession, session_settings


class AFDWorkerMixin:
    """Adds the afd session to a vLLM worker (first in the bases, before vLLM's class)."""

    vllm_config: Any
    _afd_session: AttentionSession | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        from vllm.distributed import get_tensor_model_parallel_rank

        settings = session_settings(self.vllm_config, get_tensor_model_parallel_rank())
        self._afd_session = AttentionSession(settings)

    def shutdown(self) -> None:
        session, self._afd_session = self._afd_session, None
        try:
            if session is not None:
                session.close()
        finally:
            super().shutdown()  # type: ignore[misc]


class AFDCPUWorker(AFDWorkerMixin, CPUWorker):  # type: ignore[misc]
    """vLLM's CPU worker with afd's attention session."""


class AFDGPUWorker(AFDWorkerMixin, Worker):  # type: ignore[misc]
    """vLLM's GPU worker with afd's attention session. Not yet run on a GPU vLLM (the GPU
    vLLM wheel cannot reach the GPU test machine); the same mixin runs on CPU in CI."""
