"""A prefill batch of variable-length prompts, and its split into token-level stages.

Prompts are concatenated into one flat token tensor (``T`` rows); a request's tokens
are contiguous and its positions run from 0. A batch can be cut into ``N`` *stages*:
contiguous, near-equal token ranges that may cut through a request. A stage's
attention then covers, per request it touches, a :class:`Segment` whose queries see
every earlier token of that request -- those of earlier stages come from the per-layer
prefix cache (:class:`PrefixKV`). Cutting by tokens rather than by requests lets even a
single long prompt be pipelined (stage ``i+1``'s attention runs while stage ``i`` is at
the FFN), and keeps the stages balanced.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from afd_models.errors import ConfigError


@dataclass(frozen=True)
class Segment:
    """The tokens of one request inside one stage."""

    request: int
    start: int
    """Position (within the request) of the segment's first token."""
    length: int
    row: int
    """Row of the segment's first token in the stage's tensors."""
    ends_request: bool
    """Whether the segment reaches the request's last token (no later stage needs it)."""

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.length)


@dataclass(frozen=True)
class Stage:
    """Rows ``[begin, end)`` of the flat batch, and the request segments they hold."""

    index: int
    begin: int
    end: int
    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class PromptBatch:
    """Concatenated prompt tokens with their lengths."""

    token_ids: torch.Tensor
    """int64 ``[T]``, the prompts one after another."""
    lengths: tuple[int, ...]

    @classmethod
    def from_prompts(
        cls, prompts: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str = "cpu"
    ) -> PromptBatch:
        if not prompts:
            raise ConfigError("a prefill batch needs at least one prompt")
        tensors = [torch.as_tensor(p, dtype=torch.int64).reshape(-1) for p in prompts]
        empty = [i for i, t in enumerate(tensors) if t.numel() == 0]
        if empty:
            raise ConfigError(f"prompts {empty} are empty; every prompt needs at least one token")
        return cls(torch.cat(tensors).to(device), tuple(int(t.numel()) for t in tensors))

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        """``offsets[r]`` is request ``r``'s first row; the last entry is ``T``."""
        out = [0]
        for length in self.lengths:
            out.append(out[-1] + length)
        return tuple(out)

    def positions(self) -> torch.Tensor:
        """int64 ``[T]``: each token's position inside its own prompt."""
        return torch.cat([torch.arange(n, dtype=torch.int64) for n in self.lengths]).to(
            self.token_ids.device
        )

    def last_rows(self) -> torch.Tensor:
        """Row of each prompt's last token (where next-token logits come from)."""
        return torch.tensor(self.offsets[1:], dtype=torch.int64, device=self.token_ids.device) - 1

    def stages(self, num_stages: int) -> tuple[Stage, ...]:
        """Cut the batch into at most ``num_stages`` near-equal contiguous token ranges.

        Empty ranges (fewer tokens than stages) are dropped, so every stage holds work.
        """
        if num_stages < 1:
            raise ConfigError(f"num_stages must be >= 1, got {num_stages}")
        total = self.num_tokens
        bounds = sorted({(i * total) // num_stages for i in range(num_stages + 1)})
        offsets = self.offsets
        stages: list[Stage] = []
        for begin, end in itertools.pairwise(bounds):
            segments: list[Segment] = []
            for request, length in enumerate(self.lengths):
                lo = max(begin, offsets[request])
                hi = min(end, offsets[request] + length)
                if lo < hi:
                    segments.append(
                        Segment(
                            request=request,
                            start=lo - offsets[request],
                            length=hi - lo,
                            row=lo - begin,
                            ends_request=hi == offsets[request] + length,
                        )
                    )
            stages.append(Stage(len(stages), begin, end, tuple(segments)))
        return tuple(stages)


class PrefixKV:
    """Keys and values of requests' earlier segments, per (layer, request).

    Only segments that do not end their request are kept, and an entry is dropped as
    soon as the request's last segment consumed it, so the cache holds at most the
    requests that straddle a stage boundary.
    """

    def __init__(self) -> None:
        self._store: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(
        self, layer: int, segment: Segment, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys/values of the request up to the segment's end (``[len, heads, d]``)."""
        slot = (layer, segment.request)
        prefix = self._store.pop(slot, None)
        cached = 0 if prefix is None else prefix[0].shape[0]
        if cached != segment.start:
            raise ConfigError(
                f"layer {layer}, request {segment.request}: a segment starting at position "
                f"{segment.start} needs {segment.start} cached tokens but {cached} are cached; "
                f"stages must run attention in order"
            )
        if prefix is not None:
            keys = torch.cat((prefix[0], keys))
            values = torch.cat((prefix[1], values))
        if not segment.ends_request:
            self._store[slot] = (keys, values)
        return keys, values

    def __len__(self) -> int:
        return len(self._store)
