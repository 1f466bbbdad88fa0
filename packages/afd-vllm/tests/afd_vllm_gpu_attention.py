"""The attention side of the GPU connector test, as its own process (a CUDA MPS client when
the test shares one GPU): afd_models' attention role on cuda over ``GpuAsyncAFDConnector``,
the same prompts through the monolithic model in this process (same SM share, same
rounding), both final hidden states saved for the test to compare.

    python afd_vllm_gpu_attention.py MODEL OUT ADDITIONAL_CONFIG_JSON DTYPE BUDGET MODE

MODE ``verify``: one prefill, then announce shutdown. MODE ``interrupt``: one prefill,
print ``prefilled``, wait for a line on stdin (the test interrupts the FFN process
meanwhile), prefill again and report the error that must follow as one JSON line
(``{"error": type, "message": ..., "seconds": ...}``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from afd_models import AttentionRoleModel, DeepseekConfig, MonolithicModel
from afd_models.weights import SafetensorsWeights
from afd_vllm.config import parse_afd_config
from afd_vllm.connectors.base import ModelGeometry
from afd_vllm.connectors.factory import create_connector

LENGTHS = (5, 17, 40)


def main() -> int:
    model_dir, out, additional, dtype_name, budget, mode = sys.argv[1:7]
    config = DeepseekConfig.from_json(Path(model_dir) / "config.json")
    dtype = getattr(torch, dtype_name)
    afd = parse_afd_config(json.loads(additional), expected_role="attention")
    assert afd is not None
    geometry = ModelGeometry(
        config.hidden_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        config.num_hidden_layers,
        int(budget),
        dtype_name,
    )
    connector = create_connector(afd, geometry)
    weights = SafetensorsWeights(Path(model_dir))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).cuda() for n in LENGTHS]
    attention = AttentionRoleModel(config, weights, dtype=dtype, device="cuda")
    connection = connector.connect(0, 120)
    try:
        endpoint = connection.attention_endpoint(connector.endpoint_options())
        got = attention.forward(prompts, endpoint, compute_logits=False).hidden_states
        if mode == "interrupt":
            print("prefilled", flush=True)
            sys.stdin.readline()
            started = time.monotonic()
            try:
                attention.forward(prompts, endpoint, compute_logits=False)
            except Exception as exc:  # the error the FFN's abort must produce
                seconds = time.monotonic() - started
                report = {"error": type(exc).__name__, "message": str(exc), "seconds": seconds}
                print(json.dumps(report), flush=True)
                connection.abort()
                return 0
            print(json.dumps({"error": None}), flush=True)
            return 1
        endpoint.announce_shutdown()
    finally:
        connection.close()
    backend = "grouped_mm" if dtype == torch.bfloat16 else "reference"
    reference = MonolithicModel(config, weights, dtype=dtype, device="cuda", backend=backend)
    expected = reference.forward(prompts, compute_logits=False).hidden_states
    torch.save({"got": got.float().cpu(), "expected": expected.float().cpu()}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
