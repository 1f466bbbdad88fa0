"""Packaging checks: the installed distribution is importable and self-consistent."""

from importlib import resources
from importlib.metadata import distribution

import afd_transport_cam


def test_version_matches_installed_distribution() -> None:
    assert afd_transport_cam.__version__ == distribution("afd-transport-cam").version


def test_declares_that_it_is_implemented() -> None:
    assert afd_transport_cam.IMPLEMENTED is True


def test_ships_type_information() -> None:
    assert resources.files(afd_transport_cam).joinpath("py.typed").is_file()
