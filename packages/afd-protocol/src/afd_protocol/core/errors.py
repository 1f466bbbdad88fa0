"""The afd error hierarchy.

Every failure that crosses a package boundary is an `AFDError`, so an engine can catch
one type at its top level and still tell the causes apart. Each type stands for one kind
of fix, and each message says what happened *and* what to change; callers should not
have to read our source to act.

    AFDError
    ├── ProtocolError       a header or slot on the wire is malformed (names the field)
    ├── CapacityError       a batch does not fit the fixed-size slot (names the numbers)
    ├── RingExhausted       every ring slot holds an uncombined dispatch (combine one first)
    ├── InvalidArgument     a call got a tensor of the wrong shape, dtype, device or state
    ├── TopologyError       configuration or geometry is inconsistent (names the parameter)
    ├── PeerTimeout         a peer did not answer within the configured timeout
    ├── PeerAborted         a peer published its abort word (it failed; we fail fast)
    ├── ConnectorShutdown   the opposite role announced an orderly shutdown
    └── TransportUnavailable  no transport of that name loads here (names the ones that do)
"""

from __future__ import annotations


class AFDError(Exception):
    """Base class of every error raised by afd packages."""


class ProtocolError(AFDError):
    """Malformed data on the wire: bad magic, version, range, length or checksum."""


class CapacityError(AFDError):
    """A batch does not fit the slot capacities fixed at initialisation.

    Raised before anything is written, so nothing is truncated and nothing is lost. The
    fix is a smaller batch or larger capacities.
    """


class RingExhausted(AFDError):
    """A dispatch found every ring slot holding a dispatch that was not combined yet.

    Raised before anything is written. The fix is in the caller's schedule: combine an
    earlier dispatch first, or size ``ring_depth`` to the number of stages in flight.
    """


class InvalidArgument(AFDError, ValueError):
    """A call's argument has the wrong shape, dtype, device or state (a caller's bug).

    Nothing was written; the endpoint stays usable.
    """


class TopologyError(AFDError, ValueError):
    """Inconsistent topology or slot geometry (a configuration error)."""


class PeerTimeout(AFDError, TimeoutError):
    """A peer did not publish within the timeout; it may be dead or hung."""


class PeerAborted(AFDError):
    """A peer set its abort word: it failed, so waiting for it is pointless."""


class ConnectorShutdown(AFDError):
    """The opposite role announced shutdown; a serving loop treats this as a clean exit."""


class TransportUnavailable(AFDError, LookupError):
    """No transport of that name can be loaded here: the name is misspelled, its package is
    not installed, or its package is broken. The message names the transports that are
    installed and, where it knows one, the pip package to install."""


__all__ = [
    "AFDError",
    "CapacityError",
    "ConnectorShutdown",
    "InvalidArgument",
    "PeerAborted",
    "PeerTimeout",
    "ProtocolError",
    "RingExhausted",
    "TopologyError",
    "TransportUnavailable",
]
