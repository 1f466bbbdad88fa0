"""Errors raised by afd_models.

They join the afd hierarchy (:class:`afd_protocol.AFDError`) so an engine that catches
one type at its top level also catches model-side failures, and each message says what
to change.
"""

from __future__ import annotations

from afd_protocol import AFDError


class ConfigError(AFDError, ValueError):
    """A model configuration is unsupported, incomplete or inconsistent (names the field)."""


class WeightsError(AFDError, KeyError):
    """A weight is missing from a checkpoint or has the wrong shape (names the tensor)."""

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0]) if self.args else ""


class BackendUnavailable(AFDError, RuntimeError):
    """An expert backend is unknown, or cannot run on this torch, device or dtype."""


class DeviceError(AFDError, RuntimeError):
    """A device computes wrong results in a way a start-up probe can see (names the device,
    what went wrong and what to change)."""


__all__ = ["BackendUnavailable", "ConfigError", "DeviceError", "WeightsError"]
