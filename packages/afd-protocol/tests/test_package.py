"""Packaging: the installed distribution exposes the documented API with type information."""

from __future__ import annotations

from importlib import resources
from importlib.metadata import distribution

import afd_protocol


def test_version_matches_installed_distribution() -> None:
    assert afd_protocol.__version__ == distribution("afd-protocol").version


def test_ships_type_information() -> None:
    assert resources.files(afd_protocol).joinpath("py.typed").is_file()


def test_everything_in_all_is_importable() -> None:
    for name in afd_protocol.__all__:
        assert getattr(afd_protocol, name) is not None, name


def test_errors_form_one_hierarchy() -> None:
    errors = [
        afd_protocol.ProtocolError,
        afd_protocol.CapacityError,
        afd_protocol.TopologyError,
        afd_protocol.PeerTimeout,
        afd_protocol.PeerAborted,
        afd_protocol.ConnectorShutdown,
    ]
    assert all(issubclass(e, afd_protocol.AFDError) for e in errors)
    assert issubclass(afd_protocol.PeerTimeout, TimeoutError)
