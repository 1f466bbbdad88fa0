"""Shared test set-up: make the multi-process worker module importable by spawned ranks,
and check that no test leaves a shared-memory segment behind."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))  # spawned children inherit sys.path

from afd_protocol.shm import leftover_segments

# The repository's conftest.py sets this profile too; this one also holds where the package's
# tests run outside the repository (its mutation run, its standalone check).
settings.register_profile("afd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("afd")


@pytest.fixture(autouse=True, scope="session")
def no_shared_memory_leaks() -> Iterator[None]:
    before = set(leftover_segments())
    yield
    leaked = set(leftover_segments()) - before
    assert not leaked, f"tests leaked shared-memory segments: {sorted(map(str, leaked))}"
