#!/usr/bin/env python3
"""Prove that every package stands alone: its wheel builds, installs into a clean venv
with only its declared dependencies, imports from that venv, and passes its own tests
(all but those marked ``slow``: they already ran in ``make pytest``, and a second run in
the clean venv would add minutes on 2 cores for no new information about dependencies).

A dependency that a package uses but does not declare fails here, because the clean venv
holds nothing else. The one shared piece is torch (large, and identical for every
package): it is installed once into ``build/standalone/torch-site`` and made visible to
each clean venv through a ``.pth`` file.

Usage: standalone_check.py PACKAGE_DIR [PACKAGE_DIR ...]   (run by ``make test``)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "standalone"
DIST = WORK / "dist"
TORCH_SITE = WORK / "torch-site"


def sh(cmd: list[str], log: Path, cwd: Path | None = None) -> bool:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, check=False)
    return result.returncode == 0


def ensure_torch_site(log: Path) -> None:
    spec = os.environ.get("TORCH_SPEC", f"torch=={version('torch').split('+')[0]}")
    stamp = TORCH_SITE / ".spec"
    if stamp.exists() and stamp.read_text() == spec:
        return
    shutil.rmtree(TORCH_SITE, ignore_errors=True)
    print(f"  installing {spec} once into {TORCH_SITE.relative_to(REPO)}", flush=True)
    if not sh(
        [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(TORCH_SITE), spec], log
    ):
        raise SystemExit(f"could not install {spec}; see {log}")
    stamp.write_text(spec)


def check(package_dir: Path, log: Path) -> tuple[str, str]:
    found = re.search(r'^name = "([^"]+)"', (package_dir / "pyproject.toml").read_text(), re.M)
    if not found:
        return "build", "no project name in pyproject.toml"
    name = found.group(1)
    module = name.replace("-", "_")
    wheels = sorted(DIST.glob(f"{module}-*.whl"))
    if not wheels:
        return "build", "no wheel"
    venv = WORK / "venvs" / name
    shutil.rmtree(venv, ignore_errors=True)
    if not sh([sys.executable, "-m", "venv", str(venv)], log):
        return "venv", "python -m venv failed"
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "afd-shared-torch.pth").write_text(f"{TORCH_SITE}\n")
    if not sh(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--find-links",
            str(DIST),
            f"{wheels[-1]}[test]",
        ],
        log,
    ):
        return "install", "pip install of the wheel failed"
    probe = f"import {module}, sys; print({module}.__file__)"
    where = subprocess.run(
        [str(py), "-c", probe], capture_output=True, text=True, cwd=WORK, check=False
    )
    if where.returncode != 0 or not where.stdout.strip().startswith(str(venv)):
        with log.open("a") as out:
            out.write(where.stdout + where.stderr)
        return "import", f"{module} does not import from the clean venv"
    tests = package_dir / "tests"
    if not sh(
        [
            str(py),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow and not timing",
            "-c",
            str(REPO / "pyproject.toml"),
            "--rootdir",
            str(REPO),
            str(tests),
        ],
        log,
        cwd=WORK,
    ):
        return "tests", "its tests failed in the clean venv"
    return "ok", "wheel built, installed alone, imported, tests passed"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    log = WORK / "standalone.log"
    log.write_text("")
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir(parents=True)
    print("standalone package check (log: build/standalone/standalone.log)", flush=True)
    dirs = [REPO / d for d in argv]
    for d in dirs:
        if not sh(
            [
                sys.executable,
                "-m",
                "build",
                "--wheel",
                "--no-isolation",
                "--outdir",
                str(DIST),
                str(d),
            ],
            log,
        ):
            print(f"  {d.name}: wheel build failed; see the log")
            return 1
    ensure_torch_site(log)
    failures = 0
    for d in dirs:
        start = time.perf_counter()
        stage, message = check(d, log)
        failures += stage != "ok"
        mark = "PASS" if stage == "ok" else f"FAIL at {stage}"
        print(
            f"  {d.name:24s} {mark:14s} {message} ({time.perf_counter() - start:.0f} s)", flush=True
        )
    if failures:
        print(f"{failures} package(s) do not stand alone; the log above names the step.")
        print(log.read_text()[-4000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
