"""The transport registry: every transport a launcher can open ranks over, by name.

A transport package registers one :class:`TransportSpec` under the Python entry-point group
``afd.transports`` in its ``pyproject.toml``::

    [project.entry-points."afd.transports"]
    nvshmem = "afd_transport_nvshmem.registration:NVSHMEM_TRANSPORT"

and every tool looks transports up here (:func:`get_transport`, :func:`available_transports`),
so one place maps a name to an implementation. afd's own transports are also found when
their packages are importable but not installed (a source checkout on ``PYTHONPATH``, as
``tools/gpu/suite`` runs): :data:`SOURCE_TREE_SPECS` holds the same entry-point values.
Discovery reads installed metadata and imports only the module holding each spec; a
spec's :attr:`~TransportSpec.build` imports the implementation when called, so listing
the transports on a CPU machine loads no GPU library. This module imports no transport
package: the first-party names below are plain strings, used to say which package to
install for a name that is not installed and to find afd's own in a source tree.

A spec turns a deployment's :class:`SlotLayout` and the generic :class:`TransportOptions`
into the launcher's :data:`TransportFactory` with one call, the same for every transport::

    factory = get_transport("shm").factory(slot, TransportOptions())
    launch(slot.window(), specs, transport_factory=factory)
"""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType
from typing import NoReturn

from afd_protocol.core.endpoints import Connection
from afd_protocol.core.errors import InvalidArgument, TransportUnavailable
from afd_protocol.core.layout import SharedPlacement, SlotLayout, WindowLayout
from afd_protocol.core.topology import Role

ENTRY_POINT_GROUP = "afd.transports"
"""The entry-point group transports register their :class:`TransportSpec` under."""

FIRST_PARTY_TRANSPORTS: Mapping[str, str] = MappingProxyType(
    {"shm": "afd-protocol", "nvshmem": "afd-transport-nvshmem", "cam-emulator": "afd-transport-cam"}
)
"""afd's own transports and the pip package that provides each: only for the message of a
lookup whose transport is not installed, and the order names are listed in."""

SOURCE_TREE_SPECS: Mapping[str, str] = MappingProxyType(
    {
        "shm": "afd_protocol.shm_registration:SHM_TRANSPORT",
        "nvshmem": "afd_transport_nvshmem.registration:NVSHMEM_TRANSPORT",
        "cam-emulator": "afd_transport_cam.registration:CAM_EMULATOR_TRANSPORT",
    }
)
"""afd's own entry points (as each package's ``pyproject.toml`` declares them, checked by a
test), used for a name no installed package registers when the module is importable: a
source checkout run without installing works as an installed one."""

TransportFactory = Callable[[WindowLayout, Role, int, str, float], Connection]
"""``factory(window, role, rank, rendezvous_dir, connect_timeout)`` opens one rank's
connection inside its process; it must be picklable (a module-level function, or a
``functools.partial`` of one), since spawn pickles it."""


class DeviceSharing(str, enum.Enum):
    """Whether several ranks of one deployment may run on one device."""

    FREE = "free"
    """Any number of ranks share a device as they are."""
    MPS = "mps"
    """Several ranks share a GPU only as clients of one CUDA MPS server."""
    EXCLUSIVE = "exclusive"
    """One rank per device."""


@dataclass(frozen=True)
class TransportOptions:
    """The generic knobs a launcher passes every transport's builder.

    A transport reads those it has a use for; asking one for a capability it lacks
    (``dynamic_quant``) is refused by :meth:`TransportSpec.factory`.
    """

    wait_timeout: float | None = None
    """Seconds a wait inside the transport itself may block before it fails; None: the
    transport's default. Read by transports whose operators block (``cam-emulator``); the
    window transports' waits are bounded by the endpoints' :class:`EndpointOptions`."""
    dynamic_quant: bool = False
    """Dispatch rows as int8 with a per-token scale (transports whose spec says
    ``dynamic_quant=True``)."""
    exchange_graphs: int = 0
    """Attention ranks replay each MoE layer's dispatch and combine from CUDA graphs, holding
    up to this many token counts (transports whose spec says ``exchange_graphs=True``); 0:
    eager."""
    peer_puts: bool = False
    """Send every slot with the transport's one-sided puts from local staging instead of
    storing into peers' mapped memory (transports whose spec says ``peer_puts=True``): what
    GPUs whose peers' memory cannot be mapped need."""

    def __post_init__(self) -> None:
        if self.wait_timeout is not None and not self.wait_timeout > 0:
            raise InvalidArgument(f"wait_timeout must be > 0 seconds, got {self.wait_timeout}")
        if self.exchange_graphs < 0:
            raise InvalidArgument(
                f"exchange_graphs is a number of token counts (0: none), got {self.exchange_graphs}"
            )


TransportBuilder = Callable[[SlotLayout, TransportOptions], TransportFactory]
"""``build(slot, options)`` checks that the deployment can run on the transport (raising an
:class:`AFDError` that says why not) and returns the launcher's factory; it imports the
implementation, so that discovery does not."""


@dataclass(frozen=True)
class TransportSpec:
    """One transport as the registry knows it: what it is, what it needs, how to open it."""

    name: str
    """The name users pick it by (``afd run --transport NAME``), equal to its entry point's."""
    summary: str
    """One line: what carries the rows, between which processors."""
    devices: frozenset[str]
    """The device kinds its ranks compute on (``"cpu"``, ``"cuda"``)."""
    device_sharing: DeviceSharing
    """Whether several ranks may share one device."""
    requirement: str
    """The pip requirement that provides it (``afd-transport-nvshmem``)."""
    build: TransportBuilder
    """The launcher factory builder (:data:`TransportBuilder`); call :meth:`factory`."""
    shared_placements: frozenset[SharedPlacement] = frozenset(SharedPlacement)
    """Where the shared experts may run (:class:`SharedPlacement`): a transport that carries
    routed experts only needs them on the attention side."""
    dynamic_quant: bool = False
    """Whether it accepts :attr:`TransportOptions.dynamic_quant`."""
    exchange_graphs: bool = False
    """Whether it accepts :attr:`TransportOptions.exchange_graphs`."""
    peer_puts: bool = False
    """Whether it accepts :attr:`TransportOptions.peer_puts`."""

    def __post_init__(self) -> None:
        if not self.name or not self.devices or not self.shared_placements:
            raise InvalidArgument(
                f"a transport needs a name, a device and a shared-expert placement, got "
                f"{self.name!r} on {sorted(self.devices)} with {sorted(self.shared_placements)}"
            )

    def check_device(
        self,
        device_kind: str,
        *,
        transport_option: str = "transport",
        device_option: str = "device",
    ) -> None:
        """Raise :class:`InvalidArgument` unless its ranks can compute on ``device_kind``,
        worded with the caller's option names: ``"--transport nvshmem needs --device cuda"``
        for ``transport_option="--transport", device_option="--device"``."""
        if device_kind not in self.devices:
            self._refuse(transport_option, device_option, self.devices)

    def check_shared_placement(
        self,
        placement: SharedPlacement | str,
        *,
        transport_option: str = "transport",
        shared_option: str = "shared_placement",
    ) -> None:
        """Raise :class:`InvalidArgument` unless it carries a deployment whose shared experts
        run at ``placement``, worded like :meth:`check_device`."""
        if SharedPlacement(placement) not in self.shared_placements:
            wanted = {p.value for p in self.shared_placements}
            self._refuse(transport_option, shared_option, wanted)

    def _refuse(
        self, transport_option: str, option: str, wanted: frozenset[str] | set[str]
    ) -> NoReturn:
        """``"{transport_option} NAME needs {option} A or {option} B"``, raised."""
        choices = " or ".join(f"{option} {value}" for value in sorted(wanted))
        raise InvalidArgument(f"{transport_option} {self.name} needs {choices}")

    def factory(
        self, slot: SlotLayout, options: TransportOptions | None = None
    ) -> TransportFactory:
        """The launcher's connection factory for a deployment of ``slot`` (checked now, before
        any process starts: an :class:`AFDError` says why it cannot run here)."""
        options = TransportOptions() if options is None else options
        if options.dynamic_quant and not self.dynamic_quant:
            raise InvalidArgument(f"transport {self.name} has no dynamic quantisation")
        if options.exchange_graphs and not self.exchange_graphs:
            raise InvalidArgument(f"transport {self.name} has no graph-replayed exchange")
        if options.peer_puts and not self.peer_puts:
            raise InvalidArgument(f"transport {self.name} has no put path")
        return self.build(slot, options)


def transport_names() -> tuple[str, ...]:
    """The names registered in this environment, afd's own first, without importing any."""
    return _ordered(_registered())


def available_transports() -> dict[str, TransportSpec]:
    """Every registered transport that loads here, by name (afd's own first). One whose
    package is broken is left out; :func:`get_transport` says what is wrong with it."""
    found: dict[str, TransportSpec] = {}
    for name, entry in _registered().items():
        try:
            found[name] = _load(entry)
        except TransportUnavailable:
            continue
    return {name: found[name] for name in _ordered(found)}


def get_transport(name: str) -> TransportSpec:
    """The transport registered as ``name``. A :class:`TransportUnavailable` otherwise, which
    lists the installed names and says which package to install (afd's own transports) or
    to reinstall (a registered one that does not load)."""
    registered = _registered()
    if name in registered:
        return _load(registered[name])
    installed = ", ".join(_ordered(registered)) or "none"
    if name in FIRST_PARTY_TRANSPORTS:
        raise TransportUnavailable(
            f"transport {name!r} is not installed: pip install {FIRST_PARTY_TRANSPORTS[name]} "
            f"(installed here: {installed})"
        )
    missing = [
        f"{known} (pip install {package})"
        for known, package in FIRST_PARTY_TRANSPORTS.items()
        if known not in registered
    ]
    others = f"; not installed: {', '.join(missing)}" if missing else ""
    raise TransportUnavailable(
        f"unknown transport {name!r}; the installed ones are: {installed}{others}"
    )


def _registered() -> dict[str, metadata.EntryPoint]:
    """The entry points of :data:`ENTRY_POINT_GROUP`, by name, and afd's own transports
    importable from the source tree (:data:`SOURCE_TREE_SPECS`); a name two packages claim
    is a :class:`TransportUnavailable` naming both."""
    found = _installed()
    for name, value in SOURCE_TREE_SPECS.items():
        if name not in found and _importable(value.partition(":")[0]):
            found[name] = metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)
    return found


def _importable(module: str) -> bool:
    """Whether ``module`` can be found (its top-level package imported only when the module
    is in a subpackage, as :func:`importlib.util.find_spec` does)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _installed() -> dict[str, metadata.EntryPoint]:
    """The installed entry points of :data:`ENTRY_POINT_GROUP`, by name."""
    found: dict[str, metadata.EntryPoint] = {}
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        claimed = found.get(entry.name)
        if claimed is not None and claimed.value != entry.value:
            raise TransportUnavailable(
                f"transport {entry.name!r} is registered twice: {claimed.value} (by "
                f"{_provider(claimed)}) and {entry.value} (by {_provider(entry)}); uninstall one"
            )
        found[entry.name] = entry
    return found


def _load(entry: metadata.EntryPoint) -> TransportSpec:
    """Import the spec ``entry`` points at and check that it is one, of that name."""
    try:
        spec = entry.load()
    except ImportError as exc:
        package = FIRST_PARTY_TRANSPORTS.get(entry.name) or _distribution(entry)
        fix = (
            f"pip install --force-reinstall {package}"
            if package
            else "reinstall the package that registers it"
        )
        raise TransportUnavailable(
            f"transport {entry.name!r} is registered but does not load ({exc}): {fix}"
        ) from exc
    if not isinstance(spec, TransportSpec):
        raise TransportUnavailable(
            f"transport {entry.name!r} is registered as {entry.value}, which is a "
            f"{type(spec).__name__}, not a TransportSpec (a bug of {_provider(entry)})"
        )
    if spec.name != entry.name:
        raise TransportUnavailable(
            f"transport {entry.name!r} is registered as {entry.value}, a spec named "
            f"{spec.name!r} (a bug of {_provider(entry)})"
        )
    return spec


def _distribution(entry: metadata.EntryPoint) -> str | None:
    """The name of the distribution that declares ``entry`` (as pip names it), where the
    metadata says (an entry point made by hand has none)."""
    name = getattr(getattr(entry, "dist", None), "name", None)
    return str(name) if name else None


def _provider(entry: metadata.EntryPoint) -> str:
    """``entry``'s distribution for a message."""
    return _distribution(entry) or "an unknown package"


def _ordered(names: Mapping[str, object]) -> tuple[str, ...]:
    """``names`` with afd's own transports first, in :data:`FIRST_PARTY_TRANSPORTS` order,
    then the others alphabetically."""
    first = [name for name in FIRST_PARTY_TRANSPORTS if name in names]
    return (*first, *sorted(name for name in names if name not in FIRST_PARTY_TRANSPORTS))


__all__ = [
    "ENTRY_POINT_GROUP",
    "FIRST_PARTY_TRANSPORTS",
    "SOURCE_TREE_SPECS",
    "DeviceSharing",
    "TransportBuilder",
    "TransportFactory",
    "TransportOptions",
    "TransportSpec",
    "available_transports",
    "get_transport",
    "transport_names",
]
