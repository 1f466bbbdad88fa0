"""A prefill batch of variable-length prompts or prompt chunks, its split into stages,
and the KV cache that joins the pieces of a prompt.

Prompts are concatenated into one flat token tensor (``T`` rows); a request's tokens are
contiguous. An entry of a batch is either a whole prompt (positions from 0) or a
:class:`PromptChunk`: tokens ``start .. start + n`` of a longer prompt, the way a serving
engine prefills a prompt longer than its batch budget over several steps (chunked
prefill). A batch can also be cut into ``N`` *stages*: contiguous, near-equal token ranges
that may cut through a request. Either way a piece's queries must see every earlier token
of its request: those of earlier stages or earlier steps come from the per-layer
:class:`KVCache`, which keeps MLA's compressed latent and rotary key per token (what an
MLA engine caches, ``kv_lora_rank + qk_rope_head_dim`` numbers a token) and expands them
when a later piece attends. Cutting by tokens rather than by requests lets even a single
long prompt be pipelined (stage ``i+1``'s attention runs while stage ``i`` is at the FFN),
and keeps the stages balanced.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from afd_models.errors import ConfigError


@dataclass(frozen=True)
class PromptChunk:
    """Tokens ``start .. start + len(tokens)`` of the prompt of request ``key``.

    ``key`` names the request across forward calls (the chunks of one prompt share it and
    come in order, each with the ``start`` where the last one ended); ``final`` marks the
    chunk that ends the prompt, after which its cache entries are dropped.
    """

    key: Hashable
    tokens: Sequence[int] | torch.Tensor
    start: int = 0
    final: bool = True


@dataclass(frozen=True)
class Segment:
    """The tokens of one request inside one stage."""

    request: int
    """Index of the batch entry (prompt or chunk) the segment belongs to."""
    start: int
    """Position (within the whole prompt) of the segment's first token."""
    length: int
    row: int
    """Row of the segment's first token in the stage's tensors."""
    ends_request: bool
    """Whether the segment reaches the prompt's last token (nothing later needs it)."""
    key: Hashable = None
    """The request's name in the :class:`KVCache`."""

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


Prompt = Sequence[int] | torch.Tensor | PromptChunk
"""A batch entry: a whole prompt (token ids) or one chunk of a longer prompt."""


@dataclass(frozen=True)
class PromptBatch:
    """Concatenated prompt tokens with their lengths (and, for chunks, where they start)."""

    token_ids: torch.Tensor
    """int64 ``[T]``, the prompts (or chunks) one after another."""
    lengths: tuple[int, ...]
    starts: tuple[int, ...] = ()
    """Position of each entry's first token in its prompt (empty: all 0)."""
    finals: tuple[bool, ...] = ()
    """Whether each entry ends its prompt (empty: all do)."""
    keys: tuple[Hashable, ...] = ()
    """Each entry's request name in the KV cache (empty: its index in this batch)."""

    @classmethod
    def from_prompts(
        cls, prompts: Sequence[Prompt], device: torch.device | str = "cpu"
    ) -> PromptBatch:
        if not prompts:
            raise ConfigError("a prefill batch needs at least one prompt")
        chunks = [
            p if isinstance(p, PromptChunk) else PromptChunk(("batch entry", i), p)
            for i, p in enumerate(prompts)
        ]
        tensors = [torch.as_tensor(c.tokens, dtype=torch.int64).reshape(-1) for c in chunks]
        empty = [i for i, t in enumerate(tensors) if t.numel() == 0]
        if empty:
            raise ConfigError(f"prompts {empty} are empty; every prompt needs at least one token")
        negative = [i for i, c in enumerate(chunks) if c.start < 0]
        if negative:
            raise ConfigError(f"chunks {negative} start before position 0")
        keys = [c.key for c in chunks]
        if len(set(keys)) != len(keys):
            raise ConfigError("a batch holds two chunks of one request; give them one at a time")
        return cls(
            torch.cat(tensors).to(device),
            tuple(int(t.numel()) for t in tensors),
            tuple(c.start for c in chunks),
            tuple(c.final for c in chunks),
            tuple(keys),
        )

    def start_of(self, entry: int) -> int:
        return self.starts[entry] if self.starts else 0

    def is_final(self, entry: int) -> bool:
        return self.finals[entry] if self.finals else True

    def key_of(self, entry: int) -> Hashable:
        return self.keys[entry] if self.keys else ("batch entry", entry)

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
        return torch.cat(
            [
                torch.arange(self.start_of(i), self.start_of(i) + n, dtype=torch.int64)
                for i, n in enumerate(self.lengths)
            ]
        ).to(self.token_ids.device)

    def last_rows(self) -> torch.Tensor:
        """Row of each prompt's last token (where next-token logits come from)."""
        return torch.tensor(self.offsets[1:], dtype=torch.int64, device=self.token_ids.device) - 1

    def stages(self, num_stages: int, min_stage_tokens: int = 0) -> tuple[Stage, ...]:
        """Cut the batch into at most ``num_stages`` near-equal contiguous token ranges.

        Empty ranges (fewer tokens than stages) are dropped, so every stage holds work.
        ``min_stage_tokens`` > 0 cuts fewer ranges where the batch is small: at most
        ``num_tokens // min_stage_tokens`` of them (at least one), so no stage is cut below
        that size (:func:`stage_count`).
        """
        num_stages = stage_count(self.num_tokens, num_stages, min_stage_tokens)
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
                            start=self.start_of(request) + lo - offsets[request],
                            length=hi - lo,
                            row=lo - begin,
                            ends_request=self.is_final(request) and hi == offsets[request] + length,
                            key=self.key_of(request),
                        )
                    )
            stages.append(Stage(len(stages), begin, end, tuple(segments)))
        return tuple(stages)


class KVCache:
    """Per (layer, request): MLA's compressed keys of the request's tokens so far.

    Each entry holds ``[n, kv_lora_rank]`` normalised latents and ``[n, qk_rope_head_dim]``
    rotated rope keys for positions ``0 .. n``. A piece that does not end its request is
    appended and kept; the piece that ends it takes the entry out. So the cache holds only
    requests in progress: those cut by a stage boundary inside one forward, and those whose
    later chunks come in a later forward (then the caller keeps the cache between calls).
    """

    def __init__(self) -> None:
        self._store: dict[tuple[int, Hashable], tuple[torch.Tensor, torch.Tensor]] = {}

    def cached(self, layer: int, key: Hashable) -> int:
        """Tokens of request ``key`` cached for ``layer``."""
        entry = self._store.get((layer, key))
        return 0 if entry is None else int(entry[0].shape[0])

    def extend(
        self, layer: int, segment: Segment, latent: torch.Tensor, rope_keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents and rope keys of the request up to the segment's end."""
        slot = (layer, segment.key)
        prefix = self._store.pop(slot, None)
        cached = 0 if prefix is None else prefix[0].shape[0]
        if cached != segment.start:
            raise ConfigError(
                f"layer {layer}, request {segment.key!r}: a piece starting at position "
                f"{segment.start} needs {segment.start} cached tokens but {cached} are cached; "
                f"stages and chunks must run in order, each chunk starting where the last ended"
            )
        if prefix is not None:
            latent = torch.cat((prefix[0], latent))
            rope_keys = torch.cat((prefix[1], rope_keys))
        if not segment.ends_request:
            self._store[slot] = (latent, rope_keys)
        return latent, rope_keys

    def requests(self) -> set[Hashable]:
        """Requests with something cached (in progress)."""
        return {key for _, key in self._store}

    def drop(self, key: Hashable) -> None:
        """Forget request ``key`` (abandoned: its final chunk will not come)."""
        for slot in [s for s in self._store if s[1] == key]:
            del self._store[slot]

    def __len__(self) -> int:
        return len(self._store)


def stage_count(num_tokens: int, num_stages: int, min_stage_tokens: int = 0) -> int:
    """How many stages a step of ``num_tokens`` tokens is cut into: ``num_stages``, or fewer
    where ``min_stage_tokens`` > 0 and the step is small -- ``num_tokens //
    min_stage_tokens`` but at least one.

    Why a floor: a stage's fixed costs (its kernel launches, its exchange per MoE layer)
    do not shrink with its tokens, so cutting a small step only multiplies them. On one
    H200 under MPS, v2-lite's attention took 3.3 ms per MoE layer for a 512-token stage and
    3.0 ms for the whole 1,024-token step (``docs/benchmarks.md``). vLLM's dual-batch
    overlap keeps a threshold of its own for the same reason.
    """
    if num_stages < 1:
        raise ConfigError(f"num_stages must be >= 1, got {num_stages}")
    if min_stage_tokens < 0:
        raise ConfigError(f"min_stage_tokens must be >= 0, got {min_stage_tokens}")
    if min_stage_tokens == 0:
        return num_stages
    return max(1, min(num_stages, num_tokens // min_stage_tokens))
