"""The MoE exchange of a few rows at every MoE layer, recorded by a replica for the
verification to check against the reference's experts one layer at a time.

The final hidden state of a request (what :mod:`afd_tools.run.verify` compares end to end)
carries every layer's rounding: over many layers in bfloat16 two correct computations drift
apart by about the tolerance, so a small error of the exchange could hide in that drift.
The exchange itself has no depth: what the FFN ranks return for a row at layer ``l`` is the
weighted sum of its experts on that row, whatever came before. So each step records, at
every MoE layer, for the last token of each of its chunks: the row dispatched, the experts
and weights it went out with, and what the combine returned; the verification recomputes
the same rows with the reference's experts
(:meth:`afd_models.MoELayer.exchanged`) and compares them row by row, at one layer's
rounding.

:class:`ExchangeLog` is the forward's observer (:data:`afd_models.ExchangeObserver`): each
call copies out the probed rows on the device (one small copy per MoE layer and stage, no
host synchronisation), and :meth:`ExchangeLog.take`, after the step's end time was taken,
moves them to the CPU as one :class:`StepExchanges`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ExchangeError(RuntimeError):
    """The exchange record of a step does not cover what the step ran (a layer or a row
    missing)."""


@dataclass(frozen=True)
class StepExchanges:
    """One step's probed rows at every MoE layer, on the CPU."""

    rows: tuple[int, ...]
    """The step's rows that were probed (the last token of each chunk, in chunk order)."""
    x: torch.Tensor
    """``[moe layers, P, H]`` (model dtype): each probed row as dispatched."""
    topk_ids: torch.Tensor
    """int64 ``[moe layers, P, k]``: the experts it went to."""
    weights: torch.Tensor
    """float32 ``[moe layers, P, k]``: their weights, the routed scale applied."""
    out: torch.Tensor
    """``[moe layers, P, H]`` (model dtype): what the combine returned for it."""


class ExchangeLog:
    """Records the exchange of chosen rows at every MoE layer of one step's forward (the
    module docstring): :meth:`expect` names the rows before the step, the forward calls the
    log at every MoE layer (stages in order, each with its rows of the step), :meth:`take`
    returns the record."""

    def __init__(self, moe_layers: Sequence[int]) -> None:
        self.moe_layers = tuple(moe_layers)
        self._rows: tuple[int, ...] = ()
        self._seen: dict[int, int] = {}
        self._pieces: dict[
            int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]]
        ] = {}

    def expect(self, rows: Sequence[int]) -> None:
        """Probe the step's ``rows`` (ascending) in the next forward; starts a new record."""
        self._rows = tuple(rows)
        self._seen = {}
        self._pieces = {}

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        begin = self._seen.get(layer, 0)
        end = begin + x.shape[0]
        self._seen[layer] = end
        local = [row - begin for row in self._rows if begin <= row < end]
        if not local:
            return
        # One copy in the timed step (x and out share the model dtype; out may be a buffer
        # the next layer reuses); the router's ids and weights are fresh tensors, kept as
        # they are and cut at :meth:`take`.
        rows = torch.cat([t.narrow(0, r, 1) for t in (x, out) for r in local])
        self._pieces.setdefault(layer, []).append((rows, topk_ids, weights, local))

    def take(self) -> StepExchanges | None:
        """The record of the forward since :meth:`expect`, on the CPU (``None`` when no row
        was expected: a dummy step); :class:`ExchangeError` if a MoE layer or a row is
        missing from it."""
        rows, self._rows = self._rows, ()
        pieces, self._pieces = self._pieces, {}
        if not rows:
            return None
        missing = [layer for layer in self.moe_layers if layer not in pieces]
        if missing:
            raise ExchangeError(f"no exchange was recorded for MoE layers {missing}")
        columns: list[list[torch.Tensor]] = [[], [], [], []]
        for layer in self.moe_layers:
            parts: list[list[torch.Tensor]] = [[], [], [], []]
            for rows_of_call, topk_ids, topk_weights, local in pieces[layer]:
                half = len(local)
                parts[0].append(rows_of_call[:half])
                parts[1].append(torch.cat([topk_ids.narrow(0, r, 1) for r in local]))
                parts[2].append(torch.cat([topk_weights.narrow(0, r, 1) for r in local]))
                parts[3].append(rows_of_call[half:])
            for column, part in zip(columns, parts, strict=True):
                column.append(torch.cat(part))
        short = [layer for layer, probed in zip(self.moe_layers, columns[0], strict=True)
                 if probed.shape[0] != len(rows)]  # fmt: skip
        if short:
            raise ExchangeError(
                f"the exchange of MoE layers {short} covered fewer than the {len(rows)} rows probed"
            )
        x, ids, weights, out = (torch.stack(column).cpu() for column in columns)
        return StepExchanges(rows, x, ids.long(), weights.float(), out)


def last_rows(lengths: Sequence[int]) -> list[int]:
    """The row of each chunk's last token in a step of chunks of ``lengths`` tokens."""
    rows, end = [], 0
    for length in lengths:
        end += length
        rows.append(end - 1)
    return rows


__all__ = ["ExchangeError", "ExchangeLog", "StepExchanges", "last_rows"]
