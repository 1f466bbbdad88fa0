"""afd-tools: the ``afd`` command (run, bench and sim grow here as they land)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("afd-tools")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0.0.0+unknown"
