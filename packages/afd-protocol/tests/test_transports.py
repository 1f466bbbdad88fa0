"""The transport registry: discovery through entry points, lookups that say what to install,
and the checks a spec makes before any process starts.

The tests that fake the installed entry points (:func:`registry`) hold in any environment;
the others read the real one, where afd-protocol registers ``shm`` and the other afd
transports may or may not be installed (this package's clean venv has none of them).
"""

from __future__ import annotations

import functools
import math
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import tomllib

from afd_protocol import (
    FIRST_PARTY_TRANSPORTS,
    AFDError,
    DeviceSharing,
    InvalidArgument,
    SharedPlacement,
    SlotLayout,
    Topology,
    TransportFactory,
    TransportOptions,
    TransportSpec,
    TransportUnavailable,
    available_transports,
    get_transport,
    transport_names,
    transports,
)
from afd_protocol.launch import shm_transport
from afd_protocol.shm_registration import SHM_TRANSPORT
from afd_protocol.transports import ENTRY_POINT_GROUP, SOURCE_TREE_SPECS

SHM_ENTRY = "afd_protocol.shm_registration:SHM_TRANSPORT"
SLOT = SlotLayout(Topology(1, 2, 8), 64, 32, 2, dtype="float32")


def registry(
    monkeypatch: pytest.MonkeyPatch, *entries: tuple[str, str], source_tree: bool = False
) -> None:
    """Make the registry see exactly ``entries`` (``(name, "module:attribute")``), as if
    they were the ``afd.transports`` entry points of the installed packages (and afd's own
    transports importable from a source tree only with ``source_tree``)."""
    if not source_tree:
        monkeypatch.setattr(transports, "SOURCE_TREE_SPECS", {})
    points = [metadata.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in entries]
    real = metadata.entry_points

    def entry_points(**params: Any) -> Any:
        if params.get("group") == ENTRY_POINT_GROUP:
            return points
        return real(**params)

    monkeypatch.setattr(metadata, "entry_points", entry_points)


def spec(name: str = "probe", **changes: object) -> TransportSpec:
    """A CPU transport whose builder returns the shm factory, with ``changes``."""
    fields: dict[str, object] = {
        "name": name,
        "summary": "a test transport",
        "devices": frozenset({"cpu"}),
        "device_sharing": DeviceSharing.FREE,
        "requirement": "afd-probe",
        "build": lambda slot, options: shm_transport,
        **changes,
    }
    return TransportSpec(**fields)  # type: ignore[arg-type]


def test_this_package_registers_shm_with_what_it_needs() -> None:
    shm = get_transport("shm")
    assert shm is SHM_TRANSPORT
    assert shm.devices == {"cpu", "cuda"}
    assert shm.device_sharing is DeviceSharing.FREE
    assert shm.shared_placements == set(SharedPlacement)
    assert shm.requirement == FIRST_PARTY_TRANSPORTS["shm"] == "afd-protocol"
    assert not shm.dynamic_quant
    assert shm.factory(SLOT) is shm_transport
    assert "shm" in available_transports()
    assert transport_names()[0] == "shm"


def test_every_afd_transport_is_installed_or_says_which_package_to_install() -> None:
    installed = transport_names()
    for name, package in FIRST_PARTY_TRANSPORTS.items():
        if name in installed:
            found = get_transport(name)
            assert (found.name, found.requirement) == (name, package)
        else:
            with pytest.raises(TransportUnavailable, match=f"pip install {package} "):
                get_transport(name)


def test_an_unknown_name_lists_the_installed_transports_and_the_missing_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry(monkeypatch, ("shm", SHM_ENTRY))
    with pytest.raises(TransportUnavailable) as caught:
        get_transport("bogus")
    assert str(caught.value) == (
        "unknown transport 'bogus'; the installed ones are: shm; not installed: nvshmem (pip "
        "install afd-transport-nvshmem), cam-emulator (pip install afd-transport-cam)"
    )
    assert isinstance(caught.value, AFDError)
    assert isinstance(caught.value, LookupError)


def test_an_unknown_name_among_every_afd_transport_lists_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry(
        monkeypatch,
        ("cam-emulator", "afd_not_imported:SPEC"),  # names are listed without loading them
        ("shm", SHM_ENTRY),
        ("nvshmem", "afd_not_imported:SPEC"),
    )
    with pytest.raises(TransportUnavailable) as caught:
        get_transport("host")
    assert str(caught.value) == (
        "unknown transport 'host'; the installed ones are: shm, nvshmem, cam-emulator"
    )


def test_an_afd_transport_that_is_not_installed_names_its_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry(monkeypatch, ("shm", SHM_ENTRY))
    with pytest.raises(TransportUnavailable) as caught:
        get_transport("nvshmem")
    assert str(caught.value) == (
        "transport 'nvshmem' is not installed: pip install afd-transport-nvshmem (installed "
        "here: shm)"
    )


def test_nothing_registered_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    registry(monkeypatch)
    assert transport_names() == ()
    assert available_transports() == {}
    with pytest.raises(TransportUnavailable, match=r"pip install afd-protocol \(installed here: "):
        get_transport("shm")


def test_a_registered_transport_that_does_not_load_says_to_reinstall_its_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry(monkeypatch, ("shm", SHM_ENTRY), ("nvshmem", "afd_no_such_module.entry:SPEC"))
    assert transport_names() == ("shm", "nvshmem")
    assert available_transports() == {"shm": SHM_TRANSPORT}  # left out, not fatal
    with pytest.raises(TransportUnavailable) as caught:
        get_transport("nvshmem")
    assert str(caught.value) == (
        "transport 'nvshmem' is registered but does not load (No module named "
        "'afd_no_such_module'): pip install --force-reinstall afd-transport-nvshmem"
    )
    assert isinstance(caught.value.__cause__, ImportError)


def test_a_broken_third_party_registration_without_metadata_says_what_it_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry(monkeypatch, ("elsewhere", "afd_no_such_module:SPEC"))
    with pytest.raises(TransportUnavailable, match=r"reinstall the package that registers it$"):
        get_transport("elsewhere")


def test_a_registration_that_is_no_spec_or_another_name_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry(
        monkeypatch,
        ("group", "afd_protocol.transports:ENTRY_POINT_GROUP"),
        ("renamed", SHM_ENTRY),
    )
    with pytest.raises(TransportUnavailable, match=r"which is a str, not a TransportSpec"):
        get_transport("group")
    with pytest.raises(TransportUnavailable, match=r"a spec named 'shm'"):
        get_transport("renamed")
    assert available_transports() == {}


def test_one_name_claimed_twice_names_both_registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    registry(monkeypatch, ("shm", SHM_ENTRY), ("shm", "someone_else:SHM"))
    with pytest.raises(TransportUnavailable) as caught:
        transport_names()
    assert "registered twice" in str(caught.value)
    assert SHM_ENTRY in str(caught.value)
    assert "someone_else:SHM" in str(caught.value)


def test_the_same_registration_seen_twice_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    registry(monkeypatch, ("shm", SHM_ENTRY), ("shm", SHM_ENTRY))
    assert available_transports() == {"shm": SHM_TRANSPORT}


def test_names_come_afd_first_then_alphabetically(monkeypatch: pytest.MonkeyPatch) -> None:
    registry(
        monkeypatch,
        ("zeta", "z:SPEC"),
        ("cam-emulator", "c:SPEC"),
        ("alpha", "a:SPEC"),
        ("shm", SHM_ENTRY),
    )
    assert transport_names() == ("shm", "cam-emulator", "alpha", "zeta")


def test_check_device_words_the_refusal_with_the_callers_options() -> None:
    gpu_only = spec("gpu-only", devices=frozenset({"cuda"}))
    gpu_only.check_device("cuda")
    with pytest.raises(InvalidArgument) as caught:
        gpu_only.check_device("cpu")
    assert str(caught.value) == "transport gpu-only needs device cuda"
    with pytest.raises(InvalidArgument) as caught:
        gpu_only.check_device("cpu", transport_option="--transport", device_option="--device")
    assert str(caught.value) == "--transport gpu-only needs --device cuda"
    with pytest.raises(InvalidArgument) as caught:
        SHM_TRANSPORT.check_device("npu", transport_option="--transport", device_option="--device")
    assert str(caught.value) == "--transport shm needs --device cpu or --device cuda"


def test_check_shared_placement_accepts_names_and_members() -> None:
    routed_only = spec(shared_placements=frozenset({SharedPlacement.ATTENTION}))
    routed_only.check_shared_placement("attention")
    routed_only.check_shared_placement(SharedPlacement.ATTENTION)
    with pytest.raises(InvalidArgument) as caught:
        routed_only.check_shared_placement(
            "ffn", transport_option="--transport", shared_option="--shared"
        )
    assert str(caught.value) == "--transport probe needs --shared attention"
    SHM_TRANSPORT.check_shared_placement("ffn")


def test_factory_hands_the_builder_the_slot_and_options() -> None:
    seen: list[tuple[SlotLayout, TransportOptions]] = []

    def build(slot: SlotLayout, options: TransportOptions) -> TransportFactory:
        seen.append((slot, options))
        return functools.partial(shm_transport)

    quantising = spec(build=build, dynamic_quant=True)
    options = TransportOptions(wait_timeout=5.0, dynamic_quant=True)
    factory = quantising.factory(SLOT, options)
    assert isinstance(factory, functools.partial)
    assert factory.func is shm_transport
    assert seen == [(SLOT, options)]
    quantising.factory(SLOT)
    assert seen[-1] == (SLOT, TransportOptions(wait_timeout=None, dynamic_quant=False))


def test_factory_refuses_dynamic_quantisation_the_transport_lacks() -> None:
    def build(slot: SlotLayout, options: TransportOptions) -> TransportFactory:
        raise AssertionError("the builder must not run")

    with pytest.raises(InvalidArgument, match="transport probe has no dynamic quantisation"):
        spec(build=build).factory(SLOT, TransportOptions(dynamic_quant=True))


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan])
def test_options_refuse_a_wait_timeout_that_is_not_positive(seconds: float) -> None:
    with pytest.raises(InvalidArgument, match="wait_timeout must be > 0 seconds"):
        TransportOptions(wait_timeout=seconds)


@pytest.mark.parametrize(
    "changes",
    [{"name": ""}, {"devices": frozenset()}, {"shared_placements": frozenset()}],
)
def test_a_spec_needs_a_name_a_device_and_a_shared_placement(changes: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="a transport needs a name, a device"):
        spec(**changes)


def test_a_source_tree_finds_afd_transports_that_are_importable_but_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry(monkeypatch, source_tree=True)
    monkeypatch.setattr(
        transports,
        "SOURCE_TREE_SPECS",
        {"shm": SHM_ENTRY, "nvshmem": "afd_no_such_package.registration:SPEC"},
    )
    assert transport_names() == ("shm",)
    assert get_transport("shm") is SHM_TRANSPORT
    with pytest.raises(TransportUnavailable, match=r"pip install afd-transport-nvshmem"):
        get_transport("nvshmem")


def test_an_installed_registration_wins_over_the_source_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry(monkeypatch, ("shm", "afd_no_such_module.entry:SPEC"), source_tree=True)
    with pytest.raises(TransportUnavailable, match=r"registered but does not load"):
        get_transport("shm")


def test_the_source_tree_table_is_what_each_package_declares() -> None:
    packages = Path(__file__).resolve().parents[2]
    declared: dict[str, str] = {}
    for pyproject in sorted(packages.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        declared.update(project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {}))
    assert declared == dict(SOURCE_TREE_SPECS)
    assert set(SOURCE_TREE_SPECS) == set(FIRST_PARTY_TRANSPORTS)
