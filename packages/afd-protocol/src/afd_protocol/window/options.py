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
    device_pack: bool = False
    """Pack a dispatch on the device when no FFN rank can overflow (no host read of the
    counts; needs the backend's kernels and the fused combine). Off by default: with the
    inputs ready it measured slower than the host plan on 2xH200 (more, costlier launches);
    it pays only where the host read would wait behind queued compute."""
    capture_headers: bool = True
    """Use the headers a backend's wait captured with the flags (False: copy each header
    out of the window, for comparison)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.combine not in ("auto", "fused", "portable"):
            raise InvalidArgument(
                f"combine must be 'auto', 'fused' or 'portable', got {self.combine!r}"
            )
        if self.device_pack and self.combine == "portable":
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
