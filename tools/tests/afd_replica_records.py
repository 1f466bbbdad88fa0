"""What an attention replica records (its steps, its routing per step, each finished
request's final hidden state), made by the monolithic model in this process: the "run"
that the verification tests check against a reference."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from afd_models import KVCache, MonolithicModel, PromptChunk, Selection
from afd_tools.run.ranks import ModeResult
from afd_tools.run.routing import RoutingLog

Choose = Callable[[RoutingLog, int, Selection], torch.Tensor]
"""Given the routing log, a MoE layer and its selection: the top-k the replica takes
(and logs)."""


def record_steps(
    model: MonolithicModel,
    tokens: Mapping[int, torch.Tensor],
    steps: Sequence[list[tuple[int, int, int, bool]]],
    choose: Choose | None = None,
) -> ModeResult:
    """Prefill ``steps`` (per step, ``(request id, begin, end, final)`` per chunk) of
    ``tokens`` with ``model``, recording as a replica does; ``choose`` may plant another
    expert choice (default: the model's own)."""
    log = RoutingLog(model.config.moe_layers)
    result = ModeResult()

    def select(layer: int, selection: Selection) -> torch.Tensor:
        return log(layer, selection) if choose is None else choose(log, layer, selection)

    cache = KVCache()
    for step in steps:
        entries = [PromptChunk(r, tokens[r][b:e], b, final) for r, b, e, final in step]
        out = model.forward(entries, compute_logits=False, cache=cache, select=select)
        result.steps.append(step)
        result.routing.append(log.take())
        last = out.last_hidden_states().float()
        for row, (rid, _, _, final) in enumerate(step):
            if final:
                result.last_hidden[rid] = last[row].clone()
    return result
