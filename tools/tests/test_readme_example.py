"""The root README's library example (``run_job`` on a ``RunJob``) runs as written."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_the_readme_run_job_example_runs(tmp_path: Path) -> None:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    example = next(b for b in blocks if "run_job" in b)
    script = tmp_path / "run_job_example.py"
    script.write_text(example)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=280
    )
    assert result.returncode == 0, result.stderr[-4000:]
    modes = ast.literal_eval(result.stdout.strip().splitlines()[-1])  # {mode: tokens/s}
    assert set(modes) == {"async", "sync", "colocated"}
    assert all(value > 0 for value in modes.values())
