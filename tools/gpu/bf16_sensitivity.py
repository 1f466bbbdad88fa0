"""Is the bf16 verification outlier of ``afd bench prefill`` (one v3-slice request off by
1.6e-1 in every mode, colocated included, while attention ran cuDNN's kernel; gone since
commit 5b68de2 moved it to memory-efficient attention) a property of bf16 or of afd's
exchange?

No rank, no exchange here: every request of the GPU suite's workload is prefilled alone by
``MonolithicModel`` four ways -- float32 (the truth) and bfloat16, each with the
``reference`` and the ``grouped_mm`` expert backend -- and the table gives, per request,
the relative error of each bf16 variant against float32, the error between the two bf16
variants (what ``afd run``'s check measures, where the rank processes and the reference
round differently), and per MoE layer the share of tokens whose top-k expert set differs
from float32's. If the outlier request is far from float32 in bf16 alone, and its top-k
sets flip, the outlier is bf16 routing sensitivity, not afd.

    python3 tools/gpu/bf16_sensitivity.py [--preset v3-slice] [--layers 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from afd_models import KVCache, MonolithicModel, PromptChunk, preset
from afd_models import router as router_module
from afd_protocol.core.tensors import relative_error
from afd_tools.prefill.workload import Request, prompt_lengths
from afd_tools.run import ranks


class RoutingRecorder:
    """Records every router call's top-k ids (layer order) while installed."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self._original = router_module.Router.__call__

    def __enter__(self) -> RoutingRecorder:
        recorder = self
        original = self._original

        def record(router: Any, x: torch.Tensor) -> Any:
            routing = original(router, x)
            recorder.calls.append(routing.topk_ids.detach().sort(dim=-1).values.cpu())
            return routing

        router_module.Router.__call__ = record  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        router_module.Router.__call__ = self._original  # type: ignore[method-assign]


def prefill_alone(
    model: MonolithicModel, tokens: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with RoutingRecorder() as recorder:
        last = model.forward(
            [PromptChunk(0, tokens, 0, True)], compute_logits=False, cache=KVCache()
        )
    return last.last_hidden_states().float().cpu()[0], recorder.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="v3-slice")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workload", default="uneven")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-prompt-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    config = preset(args.preset, num_layers=args.layers)
    device = torch.device(args.device)
    weights = ranks.random_weights(args.seed, device)
    lengths = prompt_lengths(args.workload, args.requests, args.seed, args.max_prompt_len)
    variants = {
        "fp32": (torch.float32, "reference"),
        "bf16-reference": (torch.bfloat16, "reference"),
        "bf16-grouped_mm": (torch.bfloat16, "grouped_mm"),
    }
    results: dict[str, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {}
    for name, (dtype, backend) in variants.items():
        model = MonolithicModel(config, weights, dtype=dtype, device=str(device), backend=backend)
        results[name] = []
        for rid, length in enumerate(lengths):
            tokens = ranks.request_tokens(
                Request(rid, length, 0.0, 0), config.vocab_size, args.seed
            )
            results[name].append(prefill_alone(model, tokens))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    rows = []
    print(
        f"{args.preset} ({config.num_hidden_layers} layers), workload {args.workload}, each "
        f"request prefilled alone on {device}"
    )
    header = (
        "| request | tokens | bf16-ref vs fp32 | bf16-gmm vs fp32 | bf16-ref vs bf16-gmm "
        "| tokens with a top-k flip vs fp32, per MoE layer (bf16-ref) |"
    )
    print(header)
    print("| --- | --- | --- | --- | --- | --- |")
    for rid, length in enumerate(lengths):
        truth, truth_routes = results["fp32"][rid]
        ref, ref_routes = results["bf16-reference"][rid]
        gmm, _ = results["bf16-grouped_mm"][rid]
        flips = [
            float((a != b).any(dim=-1).float().mean())
            for a, b in zip(ref_routes, truth_routes, strict=True)
        ]
        row = {
            "request": rid,
            "tokens": length,
            "bf16_reference_vs_fp32": relative_error(ref, truth),
            "bf16_grouped_mm_vs_fp32": relative_error(gmm, truth),
            "bf16_reference_vs_grouped_mm": relative_error(gmm, ref),
            "topk_flip_share_per_layer": flips,
        }
        rows.append(row)
        print(
            f"| {rid} | {length} | {row['bf16_reference_vs_fp32']:.1e} | "
            f"{row['bf16_grouped_mm_vs_fp32']:.1e} | {row['bf16_reference_vs_grouped_mm']:.1e} | "
            + " / ".join(f"{f:.1%}" for f in flips)
            + " |"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
