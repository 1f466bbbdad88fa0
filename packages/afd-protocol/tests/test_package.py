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
        afd_protocol.InvalidArgument,
        afd_protocol.RingExhausted,
        afd_protocol.TransportUnavailable,
    ]
    assert all(issubclass(e, afd_protocol.AFDError) for e in errors)
    assert issubclass(afd_protocol.PeerTimeout, TimeoutError)
    # A caller's bad argument, a full ring and a configuration error need different fixes.
    assert not issubclass(afd_protocol.InvalidArgument, afd_protocol.TopologyError)
    assert not issubclass(afd_protocol.RingExhausted, afd_protocol.TopologyError)


def test_the_readme_examples_run_as_written() -> None:
    """Every ```python block of the package README runs without error (they assert)."""
    import re
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, str(readme), "exec"), {})
