"""CPU checks of the NVSHMEM binding: discovery, structure layouts, configuration errors,
and unique-id creation wherever the library loads (it needs no GPU for that)."""

from __future__ import annotations

import ctypes
import sys
from importlib import resources
from importlib.metadata import distribution
from pathlib import Path

import pytest
import torch

import afd_transport_nvshmem
from afd_protocol import SlotLayout, Topology, TopologyError
from afd_transport_nvshmem import (
    STRUCT_SIZES,
    NvshmemLibrary,
    NvshmemUnavailable,
    apply_single_node_defaults,
    find_host_library,
)
from afd_transport_nvshmem.binding import InitAttr, UniqueId, version_word
from afd_transport_nvshmem.mps import check_gpu_sharing


def library_or_skip() -> NvshmemLibrary:
    try:
        return NvshmemLibrary()
    except NvshmemUnavailable as exc:
        pytest.skip(f"NVSHMEM host library not installed here: {exc}")


def test_structure_sizes_match_nvshmem_static_asserts() -> None:
    assert {s.__name__: n for s, n in STRUCT_SIZES.items()} == {
        "UniqueId": 128,
        "UniqueIdArgs": 24,
        "InitArgs": 128,
        "InitAttr": 144,
    }
    for struct, size in STRUCT_SIZES.items():
        assert ctypes.sizeof(struct) == size
    assert version_word(InitAttr) == (1 << 16) + 144
    assert InitAttr.args.offset == 16  # int + padding + void* mpi_comm


def test_explicit_library_path_must_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AFD_NVSHMEM_LIB", "/nonexistent/libnvshmem_host.so.3")
    with pytest.raises(NvshmemUnavailable, match="AFD_NVSHMEM_LIB=/nonexistent") as caught:
        find_host_library()
    assert "pip install 'afd-transport-nvshmem[cu13]'" in str(caught.value)


def test_missing_library_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AFD_NVSHMEM_LIB", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(NvshmemUnavailable, match=r"libnvshmem_host\.so\.3 not found") as caught:
        NvshmemLibrary()
    assert "[cu12]" in str(caught.value)


def test_a_file_that_is_not_the_library_fails_to_load(tmp_path: Path) -> None:
    bogus = tmp_path / "libnvshmem_host.so.3"
    bogus.write_bytes(b"not a shared object")
    with pytest.raises(NvshmemUnavailable, match="cannot load"):
        NvshmemLibrary(bogus)


def test_unique_ids_are_versioned_and_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    lib = library_or_skip()
    major, _minor, _patch = lib.version()
    assert major >= 3
    first, second = lib.unique_id(), lib.unique_id()
    assert len(first) == len(second) == 128
    assert int.from_bytes(first[:4], "little") == version_word(UniqueId)
    assert first != second


def test_single_node_defaults_respect_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (
        "NVSHMEM_REMOTE_TRANSPORT",
        "NVSHMEM_DISABLE_NVLS",
        "NVSHMEM_SYMMETRIC_SIZE",
        "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
        "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "ibrc")
    env = apply_single_node_defaults(100 << 20)
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"  # the user's choice stands
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo"
    heap = int(env["NVSHMEM_SYMMETRIC_SIZE"])
    assert heap >= 100 << 20
    assert heap % (2 << 20) == 0


def test_transport_without_cuda_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from afd_transport_nvshmem import NvshmemTransport

    window = SlotLayout(Topology(1, 1, 4), 16, 8, 2).window()
    with pytest.raises(TopologyError, match="needs a CUDA device"):
        NvshmemTransport(window, "attention", 0, store=None)  # type: ignore[arg-type]
    from afd_protocol import InvalidArgument
    from afd_transport_nvshmem import NvshmemOptions

    with pytest.raises(InvalidArgument, match="wait must be 'device' or 'host'"):
        NvshmemOptions(wait="spin")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="publish must be 'stream' or 'kernel', got 'x'"):
        NvshmemOptions(publish="x")  # type: ignore[arg-type]


def test_package_metadata() -> None:
    assert afd_transport_nvshmem.__version__ == distribution("afd-transport-nvshmem").version
    assert resources.files(afd_transport_nvshmem).joinpath("py.typed").is_file()


def test_a_shared_gpu_needs_every_rank_on_it_under_mps_within_100_percent() -> None:
    name = Topology(1, 2, 8).rank_name
    one_each = {0: "GPU-a", 1: "GPU-b", 2: "GPU-c"}
    check_gpu_sharing(one_each, dict.fromkeys(one_each), name)  # no MPS needed
    shared = {0: "GPU-a", 1: "GPU-b", 2: "GPU-a"}
    check_gpu_sharing(shared, {0: 50, 1: None, 2: 50}, name)  # full MPG: 100 %
    with pytest.raises(TopologyError) as caught:
        check_gpu_sharing(shared, {0: 50, 1: 50, 2: None}, name)
    message = str(caught.value)
    assert message.startswith(
        "attention rank 0 and ffn rank 1 would share a GPU, but ffn rank 1 is not a CUDA MPS client"
    )
    assert "nvidia-cuda-mps-control -d" in message  # how to start it
    with pytest.raises(
        TopologyError, match=r"adding up to 110 % \(attention rank 0 60 %, ffn rank 1 50 %\)"
    ):
        check_gpu_sharing(shared, {0: 60, 1: None, 2: 50}, name)
