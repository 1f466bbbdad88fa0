"""The per-layer time breakdown of a mode, as ``afd run`` measures it and ``afd sim``
models it: one type for both (the measuring wrappers are in :mod:`afd_tools.run.breakdown`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerTimes:
    """Sums over a mode: seconds in each part of the MoE layers, and how many there were."""

    dispatch_s: float = 0.0
    combine_s: float = 0.0
    step_s: float = 0.0
    """Whole steps on the device's timeline."""
    barrier_s: float = 0.0
    """Sync mode: host time in the lockstep barrier before each dispatch."""
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
