"""Make the rank programs' module importable by spawned rank processes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
