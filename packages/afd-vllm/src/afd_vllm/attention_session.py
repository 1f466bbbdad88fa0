"""One attention worker's afd connection inside vLLM: opened once the model is loaded,
bound to the dispatch/combine operators, announced and closed when the worker shuts down.

Kept apart from the worker class so it is testable without vLLM: everything it needs from
vLLM's configuration is read by :func:`session_settings` through plain attributes.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from typing import Any

from afd_protocol import AttentionEndpoint, Connection
from afd_vllm import ops
from afd_vllm.config import AFDConfig, parse_afd_config
from afd_vllm.connectors.base import ModelGeometry
from afd_vllm.connectors.factory import create_connector
from afd_vllm.extra import AFDConfigError

log = logging.getLogger(__name__)

DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}
"""The dtypes the attention role runs in (vLLM's float16 DeepSeek rescales the residual
stream by the routed scale, which the FFN side does not mirror)."""


@dataclass(frozen=True)
class SessionSettings:
    """What one attention worker connects with."""

    config: AFDConfig
    geometry: ModelGeometry
    rank: int
    """This worker's attention rank: DP index x TP size + TP rank."""


def session_settings(vllm_config: Any, tp_rank: int = 0) -> SessionSettings:
    """Read the settings from vLLM's ``VllmConfig`` (raises :class:`AFDConfigError` with
    what to change)."""
    config = parse_afd_config(vllm_config.additional_config, expected_role="attention")
    if config is None:
        raise AFDConfigError('the AFD attention worker runs without an "afd" additional_config')
    model = vllm_config.model_config
    hf = model.hf_config
    dtype = DTYPE_NAMES.get(str(model.dtype))
    if dtype is None:
        raise AFDConfigError(
            f"afd-vllm's attention role runs in float32 or bfloat16, not {model.dtype}; "
            f"pass --dtype bfloat16 or --dtype float32"
        )
    geometry = ModelGeometry(
        hidden_size=hf.hidden_size,
        num_experts=hf.n_routed_experts,
        topk=hf.num_experts_per_tok,
        num_layers=hf.num_hidden_layers,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        dtype=dtype,
    )
    parallel = vllm_config.parallel_config
    rank = parallel.data_parallel_index * parallel.tensor_parallel_size + tp_rank
    if rank >= config.num_attention_ranks:
        raise AFDConfigError(
            f"this worker is attention rank {rank} but afd.num_attention_ranks is "
            f"{config.num_attention_ranks}; set it to data_parallel_size x "
            f"tensor_parallel_size"
        )
    return SessionSettings(config, geometry, rank)


class AttentionSession:
    """An open connection whose attention endpoint is bound to :mod:`afd_vllm.ops`."""

    def __init__(self, settings: SessionSettings) -> None:
        self.settings = settings
        connector = create_connector(settings.config, settings.geometry)
        timeout = settings.config.extra.connect_timeout_s
        log.info(
            "afd: attention rank %d connecting over %s (waiting up to %d s for every peer)",
            settings.rank,
            settings.config.connector,
            timeout,
        )
        self.connection: Connection | None = connector.connect(settings.rank, timeout)
        try:
            self.endpoint: AttentionEndpoint = self.connection.attention_endpoint(
                connector.endpoint_options()
            )
            ops.bind_endpoint(self.endpoint)
        except BaseException:
            self.connection.abort()
            self.connection.close()
            self.connection = None
            raise
        atexit.register(self.abort)
        log.info("afd: attention rank %d connected", settings.rank)

    def close(self) -> None:
        """Tell the FFN ranks this rank is done, then release everything (idempotent)."""
        connection, self.connection = self.connection, None
        if connection is None:
            return
        atexit.unregister(self.abort)
        ops.unbind_endpoint()
        try:
            self.endpoint.announce_shutdown()
        except BaseException:
            connection.abort()
            raise
        finally:
            connection.close()

    def abort(self) -> None:
        """The process is ending without :meth:`close`: make the peers fail fast (they see
        the abort) instead of waiting out their timeouts."""
        connection, self.connection = self.connection, None
        if connection is None:
            return
        ops.unbind_endpoint()
        connection.abort()
        connection.close()
