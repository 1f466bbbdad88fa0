"""vLLM plugin for asynchronous AFD prefill.

Not implemented yet. It will register the afd connectors with vLLM 0.32/0.33, run
attention replicas without DP coordination, and drive the FFN role from the connector.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-vllm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

IMPLEMENTED = False
"""False until this package provides its functionality; callers can check it."""
