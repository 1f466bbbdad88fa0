"""Shared test set-up: make the helper modules here importable, also by the rank
processes that ``afd run`` spawns (they inherit ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
