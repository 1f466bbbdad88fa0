#!/usr/bin/env python3
"""Prove that every package stands alone, and run its tests there: its wheel builds,
installs into a clean venv with only its declared dependencies, imports from that venv,
and passes all of its own tests (all but those marked ``timing``, a benchmark's verdict).

This is where ``make test`` runs the tests: each package's tests once, against the wheel a
user would install, so a dependency that a package uses but does not declare fails here
(the clean venv holds nothing else), and no test runs twice. ``make pytest`` runs the same
tests in the editable development venv, for a quick loop while editing.

The one shared piece is torch (large, and identical for every package): it is installed
once into ``build/standalone/torch-site`` and made visible to each clean venv through a
``.pth`` file. Every other version comes from the lock file (``locks/dev.txt``, as
``pip -c``), so a fresh clone tests against the same releases as the last run. Packages are
checked ``--jobs`` at a time (each one's output in ``build/standalone/logs/NAME.log``).

Usage: standalone_check.py [--jobs N] PACKAGE_DIR [PACKAGE_DIR ...]   (run by ``make test``)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "standalone"
DIST = WORK / "dist"
LOGS = WORK / "logs"
TORCH_SITE = WORK / "torch-site"
LOCK = REPO / "locks" / "dev.txt"
GETS_TEST_EXTRAS = {
    "afd-transport-nvshmem": ("nvidia-nvshmem", "triton"),
    "afd-models": ("triton",),
}
"""Packages whose clean venv also gets some of ``$TEST_EXTRAS``, by requirement name (the
NVSHMEM host library and Triton: the transport's CPU tests load the one, and its tests and
afd-models' run Triton kernels in the interpreter; large and GPU-side, so not declared
dependencies)."""


def test_extras(name: str) -> list[str]:
    """The requirements of ``$TEST_EXTRAS`` that package ``name``'s clean venv gets."""
    wanted = GETS_TEST_EXTRAS.get(name, ())
    return [r for r in os.environ.get("TEST_EXTRAS", "").split() if r.startswith(wanted)]


LONGEST_FIRST = ("tools", "afd-transport-nvshmem", "afd-protocol")
"""Package directories whose checks start first, longest first (CI at aa9ae10: tools 769 s,
afd-transport-nvshmem 575 s, afd-protocol 299 s; the other three under 65 s each). With the
transport third it started at ~390 s and ended last, alone, at ~950 s."""


SHARDS = {"afd-tools": ("test_run.py", "test_sim_recorded.py")}
"""Packages whose tests run as two pytest processes side by side in their clean venv (the
files named, then the rest): the tools' tests are the longest (~330 s alone), and split in
halves of about equal time they end with the other packages instead of after them. Alone
on this machine class (2026-12-05): test_run.py 110 s and test_sim_recorded.py 57 s, the
rest 147 s; with test_run.py alone in the first shard, CI's shards took 199 s and 639 s."""


def sh(
    cmd: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> bool:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        # PIP_NO_COMPILE: Python byte-compiles what it imports; compiling every installed
        # file (torch's thousands) is CPU the tests beside this one need.
        env = {**os.environ, "PIP_CONSTRAINT": str(LOCK), "PIP_NO_COMPILE": "1", **(env or {})}
        result = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, check=False, env=env
        )
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
            *test_extras(name),
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
    shards = test_shards(package_dir / "tests", SHARDS.get(name, ()))

    def run_shard(index: int, selection: list[str]) -> bool:
        shard_log = log if len(shards) == 1 else log.with_suffix(f".shard{index}.log")
        return sh(
            [
                str(py),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "not timing",
                "-c",
                str(REPO / "pyproject.toml"),
                "--rootdir",
                str(REPO),
                *selection,
            ],
            shard_log,
            cwd=WORK,
            # its own shared-memory namespace: the leak checks of the tests run beside
            # these must not count their segments
            env={"AFD_SHM_NAMESPACE": f"{module}{index}"},
        )

    with ThreadPoolExecutor(len(shards)) as pool:
        passed = list(pool.map(run_shard, range(len(shards)), shards))
    if not all(passed):
        failed = [f"shard {i} ({' '.join(shards[i])})" for i, ok in enumerate(passed) if not ok]
        return "tests", f"its tests failed in the clean venv: {', '.join(failed)}"
    return "ok", "wheel built, installed alone, imported, tests passed"


def test_shards(tests: Path, first: tuple[str, ...]) -> list[list[str]]:
    """pytest arguments for each shard of ``tests``: the files in ``first``, then the rest
    (every file once); one shard of everything when ``first`` is empty."""
    if not first:
        return [[str(tests)]]
    missing = [f for f in first if not (tests / f).is_file()]
    if missing:
        raise SystemExit(f"SHARDS names test files that do not exist in {tests}: {missing}")
    rest = [str(tests)] + [f"--ignore={tests / f}" for f in first]
    return [[str(tests / f) for f in first], rest]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="+", help="package directories (with pyproject.toml)")
    parser.add_argument("--jobs", type=int, default=2, help="packages checked at a time")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True)
    log = LOGS / "build.log"
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir(parents=True)
    print("standalone package check (logs: build/standalone/logs/)", flush=True)
    dirs = [REPO / d for d in args.packages]
    started = time.perf_counter()
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
            print(f"  {d.name}: wheel build failed; see {log.relative_to(REPO)}")
            print(log.read_text()[-4000:])
            return 1
    ensure_torch_site(log)
    print(f"  wheels built, torch ready ({time.perf_counter() - started:.0f} s)", flush=True)

    def one(d: Path) -> tuple[Path, str, str, float]:
        start = time.perf_counter()
        stage, message = check(d, LOGS / f"{d.name}.log")
        elapsed = time.perf_counter() - start
        mark = "PASS" if stage == "ok" else f"FAIL at {stage}"
        print(f"  {d.name:24s} {mark:14s} {message} ({elapsed:.0f} s)", flush=True)
        return d, stage, message, elapsed

    # The longest first, so that the last to finish is a short one.
    order = sorted(dirs, key=lambda d: LONGEST_FIRST.index(d.name) if d.name in LONGEST_FIRST
                   else len(LONGEST_FIRST))  # fmt: skip
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        outcomes = list(pool.map(one, order))
    failures = [d for d, stage, _, _ in outcomes if stage != "ok"]
    for d in failures:
        for log_file in sorted(LOGS.glob(f"{d.name}.*log")):  # NAME.log, NAME.shardK.log
            print(f"--- {d.name} ({log_file.relative_to(REPO)}, last 4000 characters) ---")
            print(log_file.read_text()[-4000:])
    if failures:
        print(f"{len(failures)} package(s) do not stand alone; the logs above name the step.")
    print(f"standalone check: {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
