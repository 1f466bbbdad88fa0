"""Packaging checks: the installed distribution is importable and self-consistent."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from importlib.metadata import distribution

import afd_models


def test_version_matches_installed_distribution() -> None:
    assert afd_models.__version__ == distribution("afd-models").version


def test_ships_type_information() -> None:
    assert resources.files(afd_models).joinpath("py.typed").is_file()


def test_everything_in_all_is_importable() -> None:
    for name in afd_models.__all__:
        assert getattr(afd_models, name) is not None, name


def test_declares_its_dependencies() -> None:
    requires = distribution("afd-models").requires or []
    names = {
        r.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()
        for r in requires
    }
    assert {"afd-protocol", "torch", "safetensors"} <= names


def test_never_imports_vllm() -> None:
    """afd_models must stay importable and vLLM-free: backends register from outside."""
    code = (
        "import sys, afd_models, afd_models.backends; "
        "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_readme_role_split_example_runs_as_written(tmp_path) -> None:
    """The README's example spawns rank processes, so it runs as a script of its own."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    example = next(b for b in blocks if "RankSpec" in b)
    script = tmp_path / "role_split_example.py"
    script.write_text(example)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
