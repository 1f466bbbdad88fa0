"""What a prefill forward returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillOutput:
    """Final hidden states of every prompt token, and next-token logits per prompt."""

    hidden_states: torch.Tensor
    """``[T, H]`` after the final norm, prompts concatenated in input order."""
    lengths: tuple[int, ...]
    logits: torch.Tensor | None
    """float32 ``[num_prompts, vocab]`` at each prompt's last token (``None`` if skipped)."""

    def per_prompt(self) -> list[torch.Tensor]:
        """``hidden_states`` split into one ``[len, H]`` tensor per prompt."""
        return list(torch.split(self.hidden_states, list(self.lengths)))

    def last_hidden_states(self) -> torch.Tensor:
        """``[num_prompts, H]``: the final hidden state of each prompt's last token."""
        ends = torch.tensor(self.lengths).cumsum(0) - 1
        return self.hidden_states.index_select(0, ends.to(self.hidden_states.device))
