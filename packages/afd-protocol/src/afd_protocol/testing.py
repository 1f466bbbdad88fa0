"""Deterministic linear experts and an independent per-token reference.

For checking any transport end to end -- the test suites, ``afd roundtrip``, and the
bring-up of a new backend. Expert ``e`` of layer ``l`` maps a row ``x`` to
``x @ W[l, e]`` and the shared expert to ``x @ S[l]``, with weights drawn from a seed, so
every rank of either role builds identical experts without exchanging them. The FFN
side computes from the work item's group list alone (it never routes); the reference
loops over tokens and their selected experts one by one, sharing no code with the
dispatch plan or the combine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from afd_protocol.core.endpoints import FFNEndpoint
from afd_protocol.core.errors import PeerTimeout
from afd_protocol.core.plan import expert_ids_from_counts
from afd_protocol.core.serving import Compute
from afd_protocol.core.workitem import WorkItem


class LinearExperts:
    """``num_layers`` x ``num_experts`` linear experts plus one shared expert per layer."""

    def __init__(self, num_layers: int, num_experts: int, hidden_size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        scale = hidden_size**-0.5
        self.routed = torch.randn(num_layers, num_experts, hidden_size, hidden_size, generator=gen)
        self.routed *= scale
        self.shared = torch.randn(num_layers, hidden_size, hidden_size, generator=gen) * scale

    def to(self, device: torch.device | str) -> LinearExperts:
        """Move the weights (for FFN ranks on an accelerator); returns ``self``."""
        self.routed = self.routed.to(device)
        self.shared = self.shared.to(device)
        return self

    def outputs(
        self, item: WorkItem, local_experts: Sequence[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An FFN rank's reply to ``item``: routed rows by group list, shared rows.

        Computed in fp32 the way any FFN does it (``grouped``, experts, ``finish``), so it
        serves every wire format.
        """
        table = torch.tensor(list(local_experts), dtype=torch.long, device=self.routed.device)
        routed, shared = [], []
        for part in item.parts:
            grouped, group_list = part.grouped()
            ids = table[expert_ids_from_counts(group_list, grouped.shape[0])]
            rows = grouped.float()
            out = torch.bmm(rows.unsqueeze(1), self.routed[item.layer][ids]).squeeze(1)
            routed.append(part.finish(out))
            shared.append(part.shared_rows.float() @ self.shared[item.layer])
        return torch.cat(routed).to(dtype), torch.cat(shared).to(dtype)

    def compute_for(self, ffn: FFNEndpoint) -> Compute:
        """The ``compute`` that :func:`~afd_protocol.core.serving.serve` runs on ``ffn``."""
        local, dtype = ffn.local_experts, ffn.dtype
        return lambda item: self.outputs(item, local, dtype)

    def reply_to(self, ffn: FFNEndpoint, item: WorkItem) -> None:
        """Compute one ``item`` taken from ``ffn`` and reply (for step-by-step tests)."""
        routed, shared = self.outputs(item, ffn.local_experts, ffn.dtype)
        ffn.reply(item, routed, shared)

    def drain(self, ffns: Sequence[FFNEndpoint], poll: float = 0.001) -> list[tuple[int, int, int]]:
        """Serve every item that is ready on each FFN rank in turn, for step-by-step tests
        in one thread; returns ``(ffn rank, replica, layer)`` of each, in service order.

        A rank is left as soon as nothing became ready within ``poll`` seconds, so this
        never waits for work that is not already published.
        """
        served = []
        for ffn in ffns:
            while True:
                try:
                    item = ffn.next_work_item(timeout=poll)
                except PeerTimeout:
                    break
                self.reply_to(ffn, item)
                served.append((ffn.rank, item.replica, item.layer))
        return served

    def reference(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        include_shared: bool,
    ) -> torch.Tensor:
        """Per token, per selected expert, in float64 on the CPU: what the combine must return."""
        x = hidden_states.detach().double().cpu()
        topk_ids, topk_weights = topk_ids.cpu(), topk_weights.cpu()
        routed, shared = self.routed[layer].double().cpu(), self.shared[layer].double().cpu()
        out = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                expert = int(topk_ids[t, j])
                out[t] += float(topk_weights[t, j]) * (x[t] @ routed[expert])
            if include_shared:
                out[t] += x[t] @ shared
        return out


def random_routing(
    num_tokens: int,
    hidden_size: int,
    topk: int,
    experts: Sequence[int],
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states, ``topk`` distinct experts per token drawn from ``experts``,
    and random positive weights."""
    pool = torch.tensor(list(experts), dtype=torch.long)
    if topk > len(pool):
        raise ValueError(f"cannot pick {topk} distinct experts from {len(pool)}")
    x = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
    if num_tokens:
        picks = [
            pool[torch.randperm(len(pool), generator=generator)[:topk]] for _ in range(num_tokens)
        ]
        ids = torch.stack(picks)
    else:
        ids = torch.empty(0, topk, dtype=torch.long)
    weights = torch.rand(num_tokens, topk, generator=generator)
    return x, ids, weights
