"""Load a script of the repository (``tools/gpu``, ``tools/dev``: not in any package) as a
module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1]
"""The ``tools`` directory."""


def load_script(relative: str) -> ModuleType:
    """The script at ``tools/<relative>`` as a module named after its file, registered in
    ``sys.modules`` (dataclasses look their module up by name)."""
    path = TOOLS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
