"""The afd error hierarchy.

Every failure that crosses a package boundary is an `AFDError`, so an engine can catch
one type at its top level and still tell the causes apart. Each message says what
happened *and* what to change; callers should not have to read our source to act.

    AFDError
    ├── ProtocolError       a header or slot on the wire is malformed (names the field)
    ├── CapacityError       a batch does not fit the fixed-size slot (names the numbers)
    ├── TopologyError       configuration or geometry is inconsistent (names the parameter)
    ├── PeerTimeout         a peer did not answer within the configured timeout
    ├── PeerAborted         a peer published its abort word (it failed; we fail fast)
    └── ConnectorShutdown   the opposite role announced an orderly shutdown
"""

from __future__ import annotations


class AFDError(Exception):
    """Base class of every error raised by afd packages."""


class ProtocolError(AFDError):
    """Malformed data on the wire: bad magic, version, range, length or checksum."""


class CapacityError(AFDError):
    """A batch does not fit the slot capacities fixed at initialisation.

    Raised before anything is written, so nothing is truncated and nothing is lost.
    """


class TopologyError(AFDError, ValueError):
    """Inconsistent topology or slot geometry (a configuration error)."""


class PeerTimeout(AFDError, TimeoutError):
    """A peer did not publish within the timeout; it may be dead or hung."""


class PeerAborted(AFDError):
    """A peer set its abort word: it failed, so waiting for it is pointless."""


class ConnectorShutdown(AFDError):
    """The opposite role announced shutdown; a serving loop treats this as a clean exit."""


__all__ = [
    "AFDError",
    "CapacityError",
    "ConnectorShutdown",
    "PeerAborted",
    "PeerTimeout",
    "ProtocolError",
    "TopologyError",
]
