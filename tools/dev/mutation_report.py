#!/usr/bin/env python3
"""Summarise `mutmut results`: the kill rate, and every surviving mutant with its diff."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter


def main(mutmut: str) -> int:
    listing = subprocess.run(
        [mutmut, "results", "--all", "true"], capture_output=True, text=True, check=False
    ).stdout
    outcomes: Counter[str] = Counter()
    survivors = []
    for line in listing.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if not name:
            continue
        outcomes[status] += 1
        if status == "survived":
            survivors.append(name)
    killed = outcomes["killed"] + outcomes["timeout"]
    judged = killed + outcomes["survived"]
    print(f"\nmutants: {dict(outcomes)}")
    if judged:
        print(f"kill rate: {killed}/{judged} = {100 * killed / judged:.1f}%")
    for name in survivors:
        diff = subprocess.run(
            [mutmut, "show", name], capture_output=True, text=True, check=False
        ).stdout
        print(f"\n--- survived: {name}\n{diff.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
