"""Where an ``afd run``'s verification spends its wall time: building the reference, its
replays of each replica, the replays that confirm a failure, the recorded exchanges'
checks, and the float32 twin's build and replays (:func:`afd_tools.run.verify.verify`).

At v2-lite's 27 layers on one GPU verification took 100-120 s of each ~170-200 s run, more
than the run itself; these parts say which of them to make cheaper, and ``afd run``'s
closing line gives them beside the verification's total.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

PARTS = ("reference", "replays", "confirmations", "exchanges", "twin", "twin replays")
"""The parts, in the order :meth:`VerificationTimes.describe` lists them."""


@dataclass
class VerificationTimes:
    """Seconds and counts per part (:data:`PARTS`): ``reference`` (the model built by
    :func:`~afd_tools.run.verify.verify` itself), ``replays`` (a replica's first replay; a
    reused one is not counted), ``confirmations`` (the second and third replays of a
    replica with a failing request), ``exchanges`` (one replica's recorded exchanges
    checked), ``twin`` (the float32 twin built) and ``twin replays``. Each part is timed to
    the end of the GPUs' work (synchronized where CUDA is in use); a part that raised is not
    counted."""

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Time the block as one more of ``part``."""
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        start = time.monotonic()
        yield
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
        self.seconds[part] = self.seconds.get(part, 0.0) + time.monotonic() - start
        self.counts[part] = self.counts.get(part, 0) + 1

    def describe(self) -> str:
        """``reference built 3.1 s, 5 replays 30.2 s, 4 confirming replays 20.0 s, exchanges
        of 5 replicas 2.0 s, float32 twin built 6.0 s, 4 twin replays 38.0 s``: the parts
        that ran, in :data:`PARTS`' order (empty when none did)."""
        return ", ".join(
            f"{_named(part, self.counts[part])} {self.seconds[part]:.1f} s"
            for part in PARTS
            if part in self.counts
        )


def _named(part: str, count: int) -> str:
    """How :meth:`VerificationTimes.describe` names ``count`` of ``part``."""
    plural = "s" * (count != 1)
    names = {
        "reference": "reference built",
        "replays": f"{count} replay{plural}",
        "confirmations": f"{count} confirming replay{plural}",
        "exchanges": f"exchanges of {count} replica{plural}",
        "twin": "float32 twin built",
        "twin replays": f"{count} twin replay{plural}",
    }
    return names[part]
