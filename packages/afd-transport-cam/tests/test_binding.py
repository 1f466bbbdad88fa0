"""The binding of the real CAM operators: lazy, and a clear error naming what to install
when they cannot load (always, on a machine without an NPU)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import types

import pytest
import torch

from afd_transport_cam.binding import (
    EMULATED,
    CamUnavailable,
    load_npu_operators,
)


def test_importing_the_package_never_imports_torch_npu() -> None:
    code = (
        "import sys, afd_transport_cam.endpoints, afd_transport_cam.binding\n"
        "import afd_transport_cam.npu, afd_transport_cam.graph_ffn\n"
        "print('torch_npu' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture
def without_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import torch_npu`` fail, as on any machine without the NPU stack."""
    real = importlib.import_module

    def no_npu(name: str, *args: object) -> object:
        if name == "torch_npu":
            raise ImportError("No module named 'torch_npu'")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib, "import_module", no_npu)


@pytest.mark.usefixtures("without_torch_npu")
def test_without_torch_npu_the_error_says_what_to_install() -> None:
    with pytest.raises(CamUnavailable, match="need torch_npu") as failure:
        load_npu_operators()
    message = str(failure.value)
    assert "afd-vllm[ascend]" in message
    assert "910B" in message
    assert "CANN" in message
    assert "--transport cam-emulator" in message
    assert isinstance(failure.value, ImportError)


def test_with_torch_npu_but_no_operators_the_error_names_them() -> None:
    # A fresh process: nothing registered under torch.ops.afd_ascend yet.
    code = (
        "import sys, types\n"
        "sys.modules['torch_npu'] = types.ModuleType('torch_npu')\n"
        "from afd_transport_cam.binding import CamUnavailable, load_npu_operators\n"
        "try:\n"
        "    load_npu_operators()\n"
        "except CamUnavailable as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch.ops.afd_ascend lacks ['afd_async_dispatch_send'" in out.stdout
    assert "build and load the CAM compact operator library" in out.stdout


def test_loaded_operators_are_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from afd_transport_cam.emulator import register_emulated_ops

    register_emulated_ops()  # stands in for the NPU library registering the same names
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    operators = load_npu_operators()
    assert operators.device_type == "npu"
    assert operators.dispatch_send is torch.ops.afd_ascend.afd_async_dispatch_send
    assert operators.combine_recv is torch.ops.afd_ascend.afd_async_combine_recv
    assert EMULATED.device_type == "cpu"


@pytest.mark.npu
@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is None, reason="needs torch_npu and Ascend NPUs"
)
def test_the_real_operators_load_on_an_ascend_machine() -> None:
    operators = load_npu_operators()
    assert operators.device_type == "npu"


@pytest.mark.usefixtures("without_torch_npu")
def test_an_npu_connection_without_torch_npu_fails_before_any_side_effect() -> None:
    import torch.distributed as dist

    from afd_protocol import SlotLayout, Topology
    from afd_transport_cam.npu import npu_connection

    layout = SlotLayout(Topology(2, 2, 4), 8, 16, 2, dtype="bfloat16")
    with pytest.raises(CamUnavailable, match="need torch_npu"):
        npu_connection(layout, "attention", 0, "tcp://127.0.0.1:29500", local_rank=0)
    assert not dist.is_initialized()  # no process group was started
