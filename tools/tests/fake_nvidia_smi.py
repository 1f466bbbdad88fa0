"""A stand-in ``nvidia-smi`` first on the PATH, for the tests that read GPUs through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """Put an ``nvidia-smi`` that runs the bash ``script`` in ``tmp_path``, first on PATH."""
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/usr/bin/env bash\n{script}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
