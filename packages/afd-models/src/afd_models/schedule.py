"""The layer-by-stage schedule that both execution paths share.

For each layer, each stage in turn: finish its MoE from the previous layer (if any),
run this layer's attention, then either the dense MLP or *begin* the MoE. With ``N``
stages, stage ``i`` of layer ``l`` begins its MoE and stage ``i+1`` runs its attention
while stage ``i``'s MoE is still out at the FFN ranks; stage ``i`` finishes it only
when its turn at layer ``l+1`` comes. So at most one MoE per stage is in flight (a ring
depth of ``N`` suffices) and attention overlaps the FFN whenever ``N > 1``. Within a
layer, stages run in order, which is what the prefix cache of a request cut by a stage
boundary needs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from afd_models.batch import KVCache, PromptBatch
from afd_models.errors import ConfigError
from afd_models.output import PrefillOutput
from afd_models.trunk import Trunk


class MoEExecution(Protocol):
    """How one path runs an MoE layer: begin (may return at once), then end."""

    def begin(self, layer: int, stage: int, x: torch.Tensor) -> Any:
        """Start the MoE of ``layer`` for ``stage`` on its post-attention-normed rows."""

    def end(self, handle: Any) -> torch.Tensor:
        """Finish what :meth:`begin` started; the MoE output ``[t, H]`` in the model dtype."""


def run_prefill(
    trunk: Trunk,
    batch: PromptBatch,
    moe: MoEExecution,
    *,
    num_stages: int = 1,
    min_stage_tokens: int = 0,
    compute_logits: bool = True,
    cache: KVCache | None = None,
) -> PrefillOutput:
    """Run ``batch`` through every layer with ``num_stages`` stages (module docstring), or
    fewer where ``min_stage_tokens`` says the batch is too small for them
    (:func:`afd_models.batch.stage_count`).

    ``cache`` holds what earlier chunks of the batch's requests left (see
    :class:`~afd_models.batch.KVCache`); a chunk that does not end its prompt needs one that
    the caller keeps for the next chunk.
    """
    config = trunk.config
    if cache is None:
        unfinished = [i for i in range(len(batch.lengths)) if not batch.is_final(i)]
        if unfinished:
            raise ConfigError(
                f"batch entries {unfinished} are chunks that do not end their prompt: pass a "
                f"KVCache and keep it for their next chunks"
            )
        cache = KVCache()
    for i in range(len(batch.lengths)):
        have = cache.cached(0, batch.key_of(i))
        if have != batch.start_of(i):
            raise ConfigError(
                f"request {batch.key_of(i)!r}: a chunk starting at position "
                f"{batch.start_of(i)} but {have} of its tokens are cached; send each chunk "
                f"where the previous one ended, with the same KVCache"
            )
    stages = batch.stages(num_stages, min_stage_tokens)
    positions = batch.positions()
    hidden = [trunk.embed_tokens(batch.token_ids[s.begin : s.end]) for s in stages]
    stage_positions = [positions[s.begin : s.end] for s in stages]
    pending: list[Any] = [None] * len(stages)
    for layer in range(config.num_hidden_layers):
        moe_layer = config.is_moe_layer(layer)
        for i, stage in enumerate(stages):
            if pending[i] is not None:
                hidden[i] = hidden[i] + moe.end(pending[i])
                pending[i] = None
            hidden[i], x = trunk.attention_block(
                layer, hidden[i], stage_positions[i], stage.segments, cache
            )
            if moe_layer:
                pending[i] = moe.begin(layer, i, x)
            else:
                hidden[i] = hidden[i] + trunk.dense_mlp(layer, x)
    for i in range(len(stages)):
        if pending[i] is not None:
            hidden[i] = hidden[i] + moe.end(pending[i])
    final = trunk.final_norm(torch.cat(hidden))
    logits = trunk.logits(final.index_select(0, batch.last_rows())) if compute_logits else None
    return PrefillOutput(final, batch.lengths, logits)
