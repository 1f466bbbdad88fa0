"""``afd-vllm ffn``: a separate process holding only its routed experts (read from a
checkpoint) serves an attention role over the host connector; the prefill it serves equals
the monolithic model's, and the process ends cleanly when the attention side shuts down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from afd_models import AttentionRoleModel, MonolithicModel, RandomWeights, preset
from afd_models.weights import SafetensorsWeights, materialize, save_checkpoint
from afd_protocol import relative_error
from afd_vllm.config import parse_afd_config
from afd_vllm.connectors.base import ModelGeometry
from afd_vllm.connectors.factory import create_connector

BUDGET = 64


def _additional(role: str, folder: Path) -> dict[str, object]:
    return {
        "afd": {
            "role": role,
            "connector": "HostAsyncAFDConnector",
            "connector_extra_config": {"rendezvous_dir": str(folder / "rdv")},
        }
    }


def _ffn_command(model: Path, folder: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "afd_vllm.cli",
        "ffn",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-num-batched-tokens",
        str(BUDGET),
        "--additional-config",
        json.dumps(_additional("ffn", folder)),
        "--connect-timeout",
        "60",
        *extra,
    ]


@pytest.mark.timeout(240)
def test_the_ffn_role_serves_a_prefill_that_matches_the_monolithic_model(tmp_path: Path) -> None:
    config = preset("tiny")
    model = save_checkpoint(tmp_path / "model", config, materialize(config, RandomWeights(7)))
    ffn = subprocess.Popen(
        _ffn_command(model, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        afd = parse_afd_config(_additional("attention", tmp_path))
        assert afd is not None
        geometry = ModelGeometry(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.num_hidden_layers,
            BUDGET,
            "float32",
        )
        connector = create_connector(afd, geometry)
        connection = connector.connect(0, 60)
        try:
            endpoint = connection.attention_endpoint(connector.endpoint_options())
            weights = SafetensorsWeights(model)
            attention = AttentionRoleModel(config, weights)
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (5, 17)]
            out = attention.forward(prompts, endpoint, compute_logits=False)
            endpoint.announce_shutdown()
        finally:
            connection.close()
        expected = MonolithicModel(config, weights).forward(prompts, compute_logits=False)
        assert relative_error(out.hidden_states, expected.hidden_states) < 1e-5
        stdout, stderr = ffn.communicate(timeout=60)
    finally:
        if ffn.poll() is None:
            ffn.kill()
            ffn.wait()
    assert ffn.returncode == 0, stderr
    assert "afd-vllm ffn: rank 0 ready (8 experts" in stdout
    layers = len(config.moe_layers)
    assert f"served {layers} work items (replica 0: {layers}); shut down" in stdout


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{}", 'afd-vllm ffn: error: --additional-config has no "afd" entry'),
        ("{not json", "afd-vllm ffn: error: --additional-config is not JSON"),
        (
            '{"afd": {"role": "attention"}}',
            "afd-vllm ffn: error: this process runs the ffn role but afd.role is 'attention'",
        ),
    ],
)
def test_bad_configuration_is_one_line_and_exit_code_2(
    tmp_path: Path, config: str, message: str
) -> None:
    command = _ffn_command(tmp_path, tmp_path)
    command[command.index("--additional-config") + 1] = config
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message)
    assert len(result.stderr.strip().splitlines()) == 1
