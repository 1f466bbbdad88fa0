"""Connectors: created lazily by name, a missing backend named with its extra, and the host
connector carrying real work between processes through the custom operators, compiled."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from afd_vllm_workers import GEOMETRY, attention, connector, ffn, open_connection

import afd_vllm
from afd_protocol import Role, transports
from afd_protocol.launch import launch
from afd_vllm.connectors.factory import connector_class
from afd_vllm.extra import AFDConfigError


def test_a_missing_backend_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def without_nvshmem(name: str, *args: Any) -> Any:
        if name == "afd_vllm.connectors.gpu":
            raise ImportError("No module named 'afd_transport_nvshmem'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_nvshmem)
    with pytest.raises(AFDConfigError, match=r"pip install 'afd-vllm\[cuda\]'"):
        connector_class("GpuAsyncAFDConnector")
    with pytest.raises(AFDConfigError, match=r"afd\.connector must be one of"):
        connector_class("Nope")


def test_a_missing_transport_is_named_with_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the transport registry has no nvshmem, the connector says that is what lacks."""
    from importlib import metadata

    real_import, real_entry_points = importlib.import_module, metadata.entry_points
    shm = metadata.EntryPoint(
        "shm", "afd_protocol.shm_registration:SHM_TRANSPORT", "afd.transports"
    )

    def without_nvshmem(name: str, *args: Any) -> Any:
        if name == "afd_vllm.connectors.gpu":
            raise ImportError("No module named 'afd_transport_nvshmem'")
        return real_import(name, *args)

    def only_shm(**params: Any) -> Any:
        return [shm] if params.get("group") == "afd.transports" else real_entry_points(**params)

    monkeypatch.setattr(importlib, "import_module", without_nvshmem)
    monkeypatch.setattr(metadata, "entry_points", only_shm)
    # nor importable from a source tree
    monkeypatch.setattr(transports, "SOURCE_TREE_SPECS", {"shm": shm.value})
    with pytest.raises(AFDConfigError) as caught:
        connector_class("GpuAsyncAFDConnector")
    assert str(caught.value) == (
        "afd.connector GpuAsyncAFDConnector needs the nvshmem transport (afd-transport-nvshmem), "
        "which is not installed (No module named 'afd_transport_nvshmem'); install it with: "
        "pip install 'afd-vllm[cuda]'"
    )


def test_the_version_gate_names_the_supported_range() -> None:
    assert afd_vllm.supported_vllm("0.32.0")
    assert afd_vllm.supported_vllm("0.33.1+cpu")
    assert not afd_vllm.supported_vllm("0.26.0")
    with pytest.raises(AFDConfigError) as caught:
        afd_vllm.check_vllm_version("0.26.0")
    assert str(caught.value) == "afd-vllm supports vLLM 0.32.x or 0.33.x; found vLLM 0.26.0"


def test_registration_is_idempotent() -> None:
    afd_vllm.register_afd()
    afd_vllm.register_afd()
    assert afd_vllm._registered


@pytest.mark.timeout(180)
def test_the_host_connector_serves_compiled_dispatch_and_combine_across_processes(
    tmp_path: Path,
) -> None:
    from afd_protocol.launch import RankSpec

    window = connector(Role.ATTENTION, str(tmp_path)).window()
    results = launch(
        window,
        [RankSpec(Role.ATTENTION, 0, attention), RankSpec(Role.FFN, 0, ffn)],
        transport_factory=open_connection,
        timeout=150,
    )
    assert results["attention rank 0"].value < 1e-4
    assert results["ffn rank 0"].value == GEOMETRY.num_layers


def test_combine_without_a_bound_endpoint_or_twice_is_refused() -> None:
    x = torch.zeros(2, 4)
    ids = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(Exception, match="no endpoint bound"):
        torch.ops.afd.moe_dispatch(x, ids, torch.ones(2, 1), 0, 0)
    with pytest.raises(Exception, match="ticket 12345 names no dispatch in flight"):
        torch.ops.afd.moe_combine(torch.tensor(12345), x)


def _record(pid: int, start_time: int | None) -> bytes:
    return json.dumps({"who": "x", "pid": pid, "start_time": start_time}).encode()


def test_a_rendezvous_left_by_a_finished_deployment_is_cleared(tmp_path: Path) -> None:
    from afd_protocol import DirectoryStore, process_start_time
    from afd_vllm.connectors.host import clear_stale_rendezvous

    dead = subprocess.Popen(["true"])  # a pid that has exited
    dead.wait()
    store = DirectoryStore(tmp_path)
    store.set("afd/rank/0", _record(dead.pid, 1))
    store.set("afd/segment/0", b"/dev/shm/afd-gone")
    assert clear_stale_rendezvous(tmp_path) is True
    assert set(store.items()) == {f"afd-vllm/claim/{os.getpid()}"}

    # A live record (this process) keeps everything, and so does this process's own claim.
    store.set("afd/rank/1", _record(os.getpid(), process_start_time(os.getpid())))
    assert clear_stale_rendezvous(tmp_path) is False
    assert "afd/rank/1" in store.items()
    assert clear_stale_rendezvous(tmp_path / "fresh") is False
