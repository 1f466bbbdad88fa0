"""Packaging checks: the installed distribution is importable and self-consistent."""

from importlib import resources
from importlib.metadata import distribution

import afd_vllm


def test_version_matches_installed_distribution() -> None:
    assert afd_vllm.__version__ == distribution("afd-vllm").version


def test_declares_that_it_is_not_implemented_yet() -> None:
    assert afd_vllm.IMPLEMENTED is False


def test_ships_type_information() -> None:
    assert resources.files(afd_vllm).joinpath("py.typed").is_file()
