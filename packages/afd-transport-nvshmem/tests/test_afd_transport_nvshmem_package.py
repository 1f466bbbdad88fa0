"""Packaging checks: the installed distribution is importable and self-consistent."""

from importlib import resources
from importlib.metadata import distribution

import afd_transport_nvshmem


def test_version_matches_installed_distribution() -> None:
    assert afd_transport_nvshmem.__version__ == distribution("afd-transport-nvshmem").version


def test_declares_that_it_is_not_implemented_yet() -> None:
    assert afd_transport_nvshmem.IMPLEMENTED is False


def test_ships_type_information() -> None:
    assert resources.files(afd_transport_nvshmem).joinpath("py.typed").is_file()
