"""Engine-agnostic DeepSeek-V2/V3 MoE model pieces for afd.

Not implemented yet (issue: afd-models). It will hold the configuration, MLA attention,
router, shared and routed experts, a monolithic reference model and the attention/FFN
role split.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-models")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = False
"""False until this package provides its functionality; callers can check it."""
