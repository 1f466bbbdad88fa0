"""The options of the window endpoints, fixed when an endpoint is made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from afd_protocol.core.endpoints import EndpointOptions
from afd_protocol.core.errors import InvalidArgument

CombineChoice = Literal["auto", "fused", "portable"]


@dataclass(frozen=True)
class WindowOptions(EndpointOptions):
    """:class:`~afd_protocol.core.endpoints.EndpointOptions` plus the window endpoints' own."""

    combine: CombineChoice = "auto"
    """How the attention side combines replies: ``fused`` with the backend's one-pass
    kernel, ``portable`` with torch ops per FFN rank, ``auto`` the kernel when the backend
    has one. Asking for ``fused`` from an endpoint without the kernel is an error."""
    device_pack: bool | None = None
    """Pack a dispatch on the device when no FFN rank can overflow (no host read of the
    counts, so the host runs ahead of the device; needs the backend's kernels and the fused
    combine). ``None`` (the default): whenever the backend's kernels have a pack and the
    combine is not ``portable``; ``True``: required (an error without the kernel);
    ``False``: always plan on the host. Behind queued compute -- the way a real layer
    issues its dispatch -- the device plan exposed 0.1-0.7 ms less per layer than the host
    plan on an H200 (``docs/benchmarks.md``); with nothing queued the host plan can be
    slightly faster."""
    capture_headers: bool = True
    """Use the headers a backend's wait captured with the flags (False: copy each header
    out of the window, for comparison)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.combine not in ("auto", "fused", "portable"):
            raise InvalidArgument(
                f"combine must be 'auto', 'fused' or 'portable', got {self.combine!r}"
            )
        if self.device_pack not in (None, True, False):
            raise InvalidArgument(
                f"device_pack must be None (auto), True or False, got {self.device_pack!r}"
            )
        if self.device_pack is True and self.combine == "portable":
            raise InvalidArgument(
                "device_pack=True needs the fused combine (a packed dispatch's counts never "
                "reach the host); use combine='auto' or 'fused'"
            )

    @classmethod
    def of(cls, options: EndpointOptions | None) -> WindowOptions:
        """``options`` as window options (the common fields kept, the rest defaulted)."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        common = {f.name: getattr(options, f.name) for f in dataclasses.fields(EndpointOptions)}
        return cls(**common)
