"""The MoE exchange of a few rows at every MoE layer, recorded by a replica for the
verification to check against the reference's experts one layer at a time.

The final hidden state of a request (what :mod:`afd_tools.run.verify` compares end to end)
carries every layer's rounding: over many layers in bfloat16 two correct computations drift
apart by about the tolerance, so a small error of the exchange could hide in that drift.
The exchange itself has no depth: what the FFN ranks return for a row at layer ``l`` is the
weighted sum of its experts on that row, whatever came before. So each step records, at
every MoE layer, for up to :data:`PROBES_PER_CHUNK` tokens of each of its chunks (the last
always among them): the row dispatched, the experts
and weights it went out with, and what the combine returned; the verification recomputes
the same rows with the reference's experts
(:meth:`afd_models.MoELayer.exchanged`) and compares them row by row, at one layer's
rounding.

:class:`ExchangeLog` is the forward's observer (:data:`afd_models.ExchangeObserver`): each
MoE layer and stage gathers its probed rows into the step's buffers on the device (five
small launches whatever the number of rows, no host synchronisation), and
:meth:`ExchangeLog.take`, after the step's end time was taken, copies the buffers to the CPU
as one :class:`StepExchanges`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class ExchangeError(RuntimeError):
    """The exchange record of a step does not cover what the step ran (a layer or a row
    missing)."""


@dataclass(frozen=True)
class StepExchanges:
    """One step's probed rows at every MoE layer, on the CPU."""

    rows: tuple[int, ...]
    """The step's rows that were probed (:func:`probed_rows`, ascending)."""
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
    log at every MoE layer as it dispatches (stages in order, each with its rows of the step)
    and the call it returns once the combine returned; :meth:`take` returns the record.

    The rows land in buffers of the whole step, made at the step's first call: per call,
    one index (the call's probed rows) and one ``index_select`` into place per tensor, on the
    forward's stream, whatever the number of rows; the host waits for nothing until
    :meth:`take`, which copies the four buffers to the CPU."""

    def __init__(self, moe_layers: Sequence[int]) -> None:
        self.moe_layers = tuple(moe_layers)
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self._rows: tuple[int, ...] = ()
        self._host_rows: torch.Tensor | None = None
        self._device_rows: torch.Tensor | None = None
        self._seen: dict[int, int] = {}
        self._filled: dict[int, int] = {}
        self._buffers: tuple[torch.Tensor, ...] | None = None

    def expect(self, rows: Sequence[int]) -> None:
        """Probe the step's ``rows`` (ascending) in the next forward; starts a new record."""
        self._rows = tuple(rows)
        self._seen, self._filled = {}, {}
        self._buffers = None
        self._device_rows = None
        self._host_rows = torch.tensor(self._rows, dtype=torch.long) if rows else None

    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor
    ) -> Callable[[torch.Tensor], None] | None:
        begin = self._seen.get(layer, 0)
        end = begin + x.shape[0]
        self._seen[layer] = end
        first = bisect.bisect_left(self._rows, begin)
        last = bisect.bisect_left(self._rows, end)
        if first == last:
            return None
        buffers = self._buffers or self._allocate(x, topk_ids)
        rows = self._rows_on(x.device)[first:last] - begin
        where = self._index[layer]
        x_rows, ids_rows, weight_rows, _ = (b[where, first:last] for b in buffers)
        torch.index_select(x, 0, rows, out=x_rows)
        torch.index_select(topk_ids.long(), 0, rows, out=ids_rows)
        torch.index_select(weights.float(), 0, rows, out=weight_rows)
        self._filled[layer] = self._filled.get(layer, 0) + last - first
        out_rows = buffers[3][where, first:last]

        def returned(out: torch.Tensor) -> None:
            torch.index_select(out, 0, rows, out=out_rows)

        return returned

    def _allocate(self, x: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shape = (len(self.moe_layers), len(self._rows))
        hidden, k = (x.shape[1],), (topk_ids.shape[1],)
        self._buffers = (
            torch.empty(shape + hidden, dtype=x.dtype, device=x.device),
            torch.empty(shape + k, dtype=torch.long, device=x.device),
            torch.empty(shape + k, dtype=torch.float32, device=x.device),
            torch.empty(shape + hidden, dtype=x.dtype, device=x.device),
        )
        return self._buffers

    def _rows_on(self, device: torch.device) -> torch.Tensor:
        """The probed rows on ``device``, copied there once per step (from page-locked
        memory without waiting, on a GPU)."""
        if self._device_rows is None or self._device_rows.device != device:
            host = self._host_rows
            assert host is not None, "called with rows to probe"
            if device.type == "cuda":
                host = host.pin_memory()
                self._host_rows = host  # alive until the copy is done
            self._device_rows = host.to(device, non_blocking=True)
        return self._device_rows

    def take(self) -> StepExchanges | None:
        """The record of the forward since :meth:`expect`, on the CPU (``None`` when no row
        was expected: a dummy step); :class:`ExchangeError` if a MoE layer or a row is
        missing from it."""
        rows, buffers, filled = self._rows, self._buffers, self._filled
        self.expect(())
        if not rows:
            return None
        missing = [layer for layer in self.moe_layers if layer not in filled]
        if missing or buffers is None:
            raise ExchangeError(f"no exchange was recorded for MoE layers {missing}")
        short = [layer for layer in self.moe_layers if filled[layer] != len(rows)]
        if short:
            raise ExchangeError(
                f"the exchange of MoE layers {short} covered fewer than the {len(rows)} rows probed"
            )
        x, ids, weights, out = (b.cpu() for b in buffers)
        return StepExchanges(rows, x, ids, weights, out)


PROBES_PER_CHUNK = 8
"""How many of a chunk's tokens have their exchange recorded at every MoE layer: all of a
chunk this short or shorter, else this many spread evenly from its first token to its last
(a fault confined to some rows -- an offset, a race -- shows where one probe would miss it;
the device cost is the same index_select whatever the count)."""


def probed_rows(lengths: Sequence[int], per_chunk: int = PROBES_PER_CHUNK) -> list[int]:
    """The rows (ascending) whose exchange a step of chunks of ``lengths`` tokens records:
    per chunk of ``n`` tokens every row when ``n <= per_chunk``, else ``per_chunk`` rows
    evenly spaced from its first to its last (both included)."""
    if per_chunk < 2:
        raise ValueError(f"probe at least 2 rows per chunk (first and last), got {per_chunk}")
    rows: list[int] = []
    start = 0
    for n in lengths:
        if n <= per_chunk:
            picks: Sequence[int] = range(n)
        else:
            picks = sorted({round(i * (n - 1) / (per_chunk - 1)) for i in range(per_chunk)})
        rows.extend(start + p for p in picks)
        start += n
    return rows


def row_owners(
    step: Sequence[tuple[int, int, int, bool]], rows: Sequence[int]
) -> list[tuple[int, int]]:
    """``(request id, position in its prompt)`` of each of a step's ``rows``; ``step`` is its
    chunks in row order, ``(request id, begin, end, final)`` each."""
    starts: list[int] = []
    total = 0
    for _, begin, end, _ in step:
        starts.append(total)
        total += end - begin
    owners = []
    for row in rows:
        if not 0 <= row < total:
            raise ExchangeError(f"probed row {row} is outside the step's {total} rows")
        chunk = bisect.bisect_right(starts, row) - 1
        rid, begin, _, _ = step[chunk]
        owners.append((rid, begin + row - starts[chunk]))
    return owners


__all__ = [
    "PROBES_PER_CHUNK",
    "ExchangeError",
    "ExchangeLog",
    "StepExchanges",
    "probed_rows",
    "row_owners",
]
