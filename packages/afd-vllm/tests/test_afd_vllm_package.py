"""Packaging checks: the installed distribution is importable and self-consistent."""

import re
from importlib import resources
from importlib.metadata import PackageNotFoundError, distribution

import pytest

import afd_vllm


def test_version_matches_installed_distribution() -> None:
    assert afd_vllm.__version__ == distribution("afd-vllm").version


def test_declares_that_it_runs() -> None:
    assert afd_vllm.IMPLEMENTED is True


def _extra_requirements() -> dict[str, set[str]]:
    """Requires-Dist of the installed distribution (the built wheel's metadata where the
    wheel is installed, as in the standalone check), grouped by extra."""
    by_extra: dict[str, set[str]] = {}
    for line in distribution("afd-vllm").requires or []:
        requirement, _, marker = line.partition(";")
        found = re.search(r"extra\s*==\s*[\"']([^\"']+)", marker)
        by_extra.setdefault(found.group(1) if found else "", set()).add(
            requirement.replace(" ", "")
        )
    return by_extra


def test_each_extra_pulls_its_transport() -> None:
    extras = _extra_requirements()
    assert extras["cuda"] == {"afd-transport-nvshmem[cu13]<0.2,>=0.1"}
    assert extras["cuda13"] == extras["cuda"]
    assert extras["cuda12"] == {"afd-transport-nvshmem[cu12]<0.2,>=0.1"}
    assert extras["ascend"] == {"afd-transport-cam<0.2,>=0.1", "vllm-ascend"}
    assert extras[""] == {"afd-protocol<0.2,>=0.1", "afd-models<0.2,>=0.1"}


def test_the_nvshmem_transport_offers_both_cuda_majors() -> None:
    """What ``cuda`` / ``cuda12`` pull in turn (checked where that package is installed)."""
    if not _installed("afd-transport-nvshmem"):
        pytest.skip("afd-transport-nvshmem is not installed here")
    nvshmem = {
        line.split(";")[0].replace(" ", "")
        for line in distribution("afd-transport-nvshmem").requires or []
        if "nvidia-nvshmem" in line
    }
    assert nvshmem == {"nvidia-nvshmem-cu12>=3.3", "nvidia-nvshmem-cu13>=3.4"}


def _installed(name: str) -> bool:
    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


def test_ships_type_information() -> None:
    assert resources.files(afd_vllm).joinpath("py.typed").is_file()
