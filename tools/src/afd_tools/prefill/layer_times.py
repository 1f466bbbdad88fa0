"""The per-layer time breakdown of a mode, as ``afd run`` measures it and ``afd sim``
models it: one type for both (the measuring wrappers are in :mod:`afd_tools.run.breakdown`).

:class:`LayerTimes` is what one rank sums up while a mode runs; :meth:`LayerTimes.as_dict`
is its record per MoE layer (the ``layer_times`` of a replica's record), and
:class:`LayerBreakdown` is a mode's summary of those records over the ranks, as the report
holds it (``modes.<mode>.breakdown``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from afd_tools.prefill.typed_json import check_value, field_error


@dataclass(frozen=True)
class LayerBreakdown:
    """Where a mode's time went, per MoE layer and mean over the attention ranks (ms), and
    what its FFN ranks served; a field is ``None`` where the mode has no such time (the
    colocated ``mono`` baseline exchanges nothing, so every field is ``None``; only AFD
    modes have FFN items).

    In the report (:meth:`to_json`) a ``None`` field is left out, so the object has the keys
    ``afd run`` has always written, in the same order; every value is finite (a value that
    is not is refused, here and when reading)."""

    barrier_ms_per_layer: float | None = None
    """Sync mode: host time in the lockstep barrier before each dispatch (0 elsewhere)."""
    combine_ms_per_layer: float | None = None
    """Waiting for the replies and their weighted sum."""
    compute_ms_per_layer: float | None = None
    """What remains of the steps after the endpoint calls and the barrier: attention,
    dense layers, router, local shared experts."""
    dispatch_ms_per_layer: float | None = None
    """Planning, packing, sending (colocated ``dp-ep``: the collectives and the experts)."""
    moe_layers: float | None = None
    """MoE layers per rank over the mode (a mean over the ranks)."""
    ffn_ms_per_item: float | None = None
    """The FFN ranks' mean expert time per work item."""
    ffn_items: float | None = None
    """Work items the FFN ranks served in this mode."""

    def __post_init__(self) -> None:
        for name, value in self._values().items():
            if not math.isfinite(value):
                raise ValueError(f"breakdown field {name!r} must be finite, got {value!r}")

    def _values(self) -> dict[str, float]:
        """The fields that are set, in declaration order."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    @property
    def empty(self) -> bool:
        """Whether the mode recorded no time at all (every field ``None``)."""
        return not self._values()

    def to_json(self) -> dict[str, float]:
        """The report's ``breakdown`` object: the fields that are set."""
        return self._values()

    @classmethod
    def from_json(cls, obj: Any, where: str, name: str = "breakdown") -> LayerBreakdown:
        """A breakdown from its :meth:`to_json` object (a missing or ``null`` key is
        ``None``); a :class:`~afd_tools.prefill.typed_json.ReportError` naming ``where``
        and the field for a key that is not a field, a value that is not a number, or one
        that is not finite."""
        if not isinstance(obj, dict):
            raise field_error(where, name, f"must be an object, got {obj!r:.80}")
        known = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, float | None] = {}
        for key, raw in obj.items():
            label = f"{name}.{key}"
            if key not in known:
                raise field_error(where, label, f"is not a breakdown field ({', '.join(known)})")
            value = check_value(raw, float | None, where, label)
            if value is not None and not math.isfinite(value):
                raise field_error(where, label, f"must be finite, got {raw!r}")
            values[key] = value
        return cls(**values)


@dataclass
class LayerTimes:
    """Sums over a mode: seconds in each part of the MoE layers, and how many there were."""

    dispatch_s: float = 0.0
    combine_s: float = 0.0
    step_s: float = 0.0
    """Whole steps on the device's timeline."""
    barrier_s: float = 0.0
    """Sync mode: the lockstep barriers before each dispatch, on the step's clock (the
    device's timeline on a GPU)."""
    layers: int = 0

    def as_dict(self) -> dict[str, float]:
        """Per MoE layer in ms; compute is what remains of the steps after the endpoint
        calls and the barrier."""
        compute = self.step_s - self.dispatch_s - self.combine_s - self.barrier_s
        per = 1e3 / max(1, self.layers)
        return {
            "moe_layers": self.layers,
            "compute_ms_per_layer": max(0.0, compute) * per,
            "dispatch_ms_per_layer": self.dispatch_s * per,
            "combine_ms_per_layer": self.combine_s * per,
            "barrier_ms_per_layer": self.barrier_s * per,
        }

    def step_entry(self, before: LayerTimes, tokens: int, square: int) -> list[float]:
        """One step's entry of a replica's ``attention_steps`` (:data:`afd_tools.prefill.
        metrics.STEP_FIELDS`): ``tokens`` and ``square`` of the step, and from these sums
        (after the step) less ``before`` (at its start), its MoE dispatches and its compute
        -- the step's time outside dispatch, combine and the barrier, as :meth:`as_dict`
        counts compute."""
        outside = (
            self.dispatch_s
            - before.dispatch_s
            + self.combine_s
            - before.combine_s
            + self.barrier_s
            - before.barrier_s
        )
        compute = max(0.0, self.step_s - before.step_s - outside)
        return [float(tokens), float(square), float(self.layers - before.layers), compute]
