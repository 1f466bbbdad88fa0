"""This package's entry in afd's transport registry: found by name, cheap to discover (no
NVSHMEM, no transport module loaded), and building the launcher's NVSHMEM factory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from afd_protocol import DeviceSharing, SlotLayout, Topology, get_transport
from afd_transport_nvshmem.registration import NVSHMEM_TRANSPORT


def test_nvshmem_is_registered_for_cuda_ranks_sharing_a_gpu_under_mps() -> None:
    nvshmem = get_transport("nvshmem")
    assert nvshmem is NVSHMEM_TRANSPORT
    assert nvshmem.devices == {"cuda"}
    assert nvshmem.device_sharing is DeviceSharing.MPS
    assert nvshmem.requirement == "afd-transport-nvshmem"
    assert not nvshmem.dynamic_quant


def test_discovering_the_transports_loads_neither_nvshmem_nor_the_transport() -> None:
    probe = textwrap.dedent(
        """
        import json
        import sys
        import afd_protocol

        def nvshmem_libraries():
            with open("/proc/self/maps") as maps:
                return {line.split()[-1] for line in maps if "nvshmem" in line.lower()}

        before = nvshmem_libraries()  # torch's own, where a CUDA build brings one
        assert "nvshmem" in afd_protocol.available_transports()
        loaded = sorted(m for m in sys.modules if m.startswith("afd_transport_nvshmem."))
        added = sorted(nvshmem_libraries() - before)
        print(json.dumps({"loaded": loaded, "libraries": added}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "afd_transport_nvshmem.registration" in found["loaded"]
    assert "afd_transport_nvshmem.transport" not in found["loaded"]
    assert "afd_transport_nvshmem.launch_support" not in found["loaded"]
    assert found["libraries"] == []


def test_the_factory_is_the_launchers_nvshmem_transport() -> None:
    from afd_transport_nvshmem.launch_support import nvshmem_transport

    slot = SlotLayout(Topology(1, 1, 4), 64, 16, 2, dtype="bfloat16")
    assert NVSHMEM_TRANSPORT.factory(slot) is nvshmem_transport


def test_exchange_graphs_reach_the_transport_options_and_other_transports_refuse_them() -> None:
    import pytest

    from afd_protocol import InvalidArgument, TransportOptions
    from afd_transport_nvshmem.launch_support import nvshmem_transport
    from afd_transport_nvshmem.transport import NvshmemOptions

    slot = SlotLayout(Topology(1, 1, 4), 64, 16, 2, dtype="bfloat16")
    factory = NVSHMEM_TRANSPORT.factory(slot, TransportOptions(exchange_graphs=4))
    assert factory.func is nvshmem_transport  # type: ignore[attr-defined]
    assert factory.keywords == {"options": NvshmemOptions(exchange_graphs=4)}  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="transport shm has no graph-replayed exchange"):
        get_transport("shm").factory(slot, TransportOptions(exchange_graphs=4))
    with pytest.raises(InvalidArgument, match="exchange_graphs is a number of token counts"):
        TransportOptions(exchange_graphs=-1)
    with pytest.raises(InvalidArgument, match="exchange_graphs is how many token counts"):
        NvshmemOptions(exchange_graphs=-1)


def test_peer_puts_reach_the_transport_as_the_put_path_and_other_transports_refuse_them() -> None:
    import pytest

    from afd_protocol import InvalidArgument, TransportOptions
    from afd_transport_nvshmem.transport import NvshmemOptions

    slot = SlotLayout(Topology(1, 1, 4), 64, 16, 2, dtype="bfloat16")
    both = TransportOptions(exchange_graphs=2, peer_puts=True)
    factory = NVSHMEM_TRANSPORT.factory(slot, both)
    assert factory.keywords == {  # type: ignore[attr-defined]
        "options": NvshmemOptions(exchange_graphs=2, data_path="put")
    }
    with pytest.raises(InvalidArgument, match="transport shm has no put path"):
        get_transport("shm").factory(slot, TransportOptions(peer_puts=True))
