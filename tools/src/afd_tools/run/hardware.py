"""What a run measured on, for its report: the GPUs as ``nvidia-smi`` lists them (name,
memory, driver), the CPU (model, cores) and the software (Python, torch and its CUDA).

Read without a CUDA context: ``afd run``'s own process must not create one before its
ranks start (they are CUDA MPS clients of a daemon started later), so the GPUs come from
``nvidia-smi``, as :mod:`afd_tools.run.capacity` reads their memory. Where it cannot say,
the record says why instead of guessing.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import torch

NVIDIA_SMI_TIMEOUT_S = 30.0
"""How long ``nvidia-smi`` may take before the answer is taken as unknown."""

GPU_FIELDS = ("name", "memory.total", "driver_version")
"""What ``nvidia-smi --query-gpu`` is asked for, per GPU, in this order."""


def nvidia_smi(fields: tuple[str, ...]) -> list[list[str]] | str:
    """One row per GPU ``nvidia-smi`` lists (its order, not necessarily CUDA's) with the
    ``fields`` asked for, as text without units; or why there is none (no ``nvidia-smi``,
    a failure, or an answer that is not one row of ``len(fields)`` values per GPU)."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except FileNotFoundError:
        return "nvidia-smi not found"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed: {type(exc).__name__}"
    rows = [[cell.strip() for cell in line.split(",")] for line in listed.splitlines()]
    rows = [row for row in rows if any(row)]
    if not rows or any(len(row) != len(fields) or not all(row) for row in rows):
        return f"nvidia-smi answered {listed.strip()[:200]!r}"
    return rows


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what Python's platform says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def hardware_record(kind: str) -> dict[str, Any]:
    """The report's ``placement.hardware`` for a run on ``kind`` (``cpu`` or ``cuda``):
    ``cpu`` (model), ``cores``, ``python``, ``torch``, and on ``cuda`` also ``cuda`` (the
    version torch was built with) and ``gpus`` (one ``{"name", "memory_mib", "driver"}``
    per GPU ``nvidia-smi`` lists) or ``gpus_unknown`` (why not)."""
    record: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if kind != "cuda":
        return record
    record["cuda"] = torch.version.cuda
    rows = nvidia_smi(GPU_FIELDS)
    if isinstance(rows, str):
        record["gpus_unknown"] = rows
    else:
        record["gpus"] = [
            {"name": name, "memory_mib": int(mib) if mib.isdigit() else mib, "driver": driver}
            for name, mib, driver in rows
        ]
    return record


def describe_hardware(record: dict[str, Any]) -> str:
    """``record`` (:func:`hardware_record`) in words: the GPUs (how many of each), then the
    CPU and the software, e.g. ``1 x NVIDIA H200 (143771 MiB, driver 580.159.04); AMD EPYC
    (16 cores); Python 3.11.9, torch 2.11.0+cu130, CUDA 13.0``."""
    parts = []
    gpus = record.get("gpus")
    if gpus:
        seen = Counter(f"{g['name']} ({g['memory_mib']} MiB, driver {g['driver']})" for g in gpus)
        parts.append(", ".join(f"{count} x {label}" for label, count in seen.items()))
    elif "gpus_unknown" in record:
        parts.append(f"GPUs unknown ({record['gpus_unknown']})")
    parts.append(f"{record.get('cpu', 'unknown CPU')} ({record.get('cores')} cores)")
    software = [f"Python {record.get('python')}", f"torch {record.get('torch')}"]
    if record.get("cuda"):
        software.append(f"CUDA {record['cuda']}")
    parts.append(", ".join(software))
    return "; ".join(parts)
