#!/usr/bin/env python3
"""Write a lock file (exact versions for ``pip -c``) from a venv built without one.

Usage: write_lock.py VENV LOCK_FILE COMMAND   (run by ``make lock``)

Every distribution installed in VENV is pinned, except afd's own packages (editable, from
this repository). A local version label (``torch 2.13.0+cpu``) is dropped: the label names
the build, and ``==2.13.0`` matches it while also matching the same release elsewhere.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

OWN = {"afd-protocol", "afd-transport-nvshmem", "afd-transport-cam", "afd-models"}
OWN |= {"afd-vllm", "afd-tools"}


def pins(venv: Path) -> list[str]:
    listing = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = []
    for entry in json.loads(listing):
        name = str(entry["name"]).lower().replace("_", "-")
        if name in OWN or name == "pip":
            continue
        found.append(f"{name}=={str(entry['version']).split('+')[0]}")
    return sorted(found)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    venv, lock, command = Path(argv[0]), Path(argv[1]), argv[2]
    python = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print(sys.version.split()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    header = [
        f"# Exact versions for pip -c, written by `{command}` on {datetime.date.today()}",
        f"# (Python {python}). Regenerate with `make lock`; review the diff before committing.",
    ]
    pinned = pins(venv)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("\n".join([*header, *pinned]) + "\n")
    print(f"wrote {lock} ({len(pinned)} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
