"""What a run measured on, as its report records it: GPUs from nvidia-smi (never a CUDA
context in afd run's own process), the CPU and the software."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch
from fake_nvidia_smi import fake_nvidia_smi

from afd_tools.run import hardware
from afd_tools.run.hardware import describe_hardware, hardware_record


def test_a_gpu_run_records_each_gpu_nvidia_smi_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(
        tmp_path,
        monkeypatch,
        'printf "NVIDIA H200, 143771, 580.159.04\\nNVIDIA H200, 143771, 580.159.04\\n"',
    )
    record = hardware_record("cuda")
    assert (
        record["gpus"]
        == [{"name": "NVIDIA H200", "memory_mib": 143771, "driver": "580.159.04"}] * 2
    )
    assert record["cuda"] == torch.version.cuda
    assert record["torch"] == torch.__version__
    assert record["python"] == platform.python_version()
    assert record["cores"] == os.cpu_count()
    assert describe_hardware(record).startswith("2 x NVIDIA H200 (143771 MiB, driver 580.159.04); ")


@pytest.mark.parametrize(
    ("script", "why"),
    [
        ("exit 9", "nvidia-smi failed: CalledProcessError"),
        ('echo "NVIDIA H200, 143771"', "nvidia-smi answered 'NVIDIA H200, 143771'"),
        ("echo", "nvidia-smi answered ''"),
        ("sleep 60", "nvidia-smi failed: TimeoutExpired"),
    ],
    ids=["fails", "short row", "empty", "hangs"],
)
def test_gpus_nvidia_smi_cannot_tell_are_recorded_as_unknown_with_the_reason(
    script: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware, "NVIDIA_SMI_TIMEOUT_S", 2.0)
    fake_nvidia_smi(tmp_path, monkeypatch, script)
    record = hardware_record("cuda")
    assert "gpus" not in record
    assert record["gpus_unknown"] == why
    assert describe_hardware(record).startswith(f"GPUs unknown ({why}); ")


def test_no_nvidia_smi_and_a_cpu_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-smi
    assert hardware_record("cuda")["gpus_unknown"] == "nvidia-smi not found"
    cpu = hardware_record("cpu")
    assert set(cpu) == {"cpu", "cores", "python", "torch"}  # no GPU asked about on the CPU
    assert cpu["cpu"]
    assert describe_hardware(cpu) == (
        f"{cpu['cpu']} ({os.cpu_count()} cores); Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )
