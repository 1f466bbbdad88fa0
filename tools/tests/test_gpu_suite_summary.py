"""tools/gpu/summary.py, the GPU suite's summary table: it counts every failed test and
check, exits 1 when there is one, and names each at the end (a log's tail shows them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SUMMARY = Path(__file__).resolve().parents[1] / "gpu" / "summary.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="t" name="test_fine"/>
<testcase classname="t" name="test_broken"><failure message="boom">boom</failure></testcase>
<testcase classname="t" name="test_not_here"><skipped message="no vLLM"/></testcase>
</testsuite></testsuites>
"""


def _summary(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SUMMARY), str(folder)], capture_output=True, text=True, timeout=60
    )


def test_each_failed_test_and_missing_result_is_counted_and_named_last(tmp_path: Path) -> None:
    (tmp_path / "gpu-tests.xml").write_text(JUNIT)
    (tmp_path / "parity-tests.xml").write_text(JUNIT.replace("test_broken", "test_parity_x"))
    # No bench-nvshmem.json (its step failed), no loopback-formats.json, no prefill runs.
    shown = _summary(tmp_path)
    assert shown.returncode == 1, shown.stderr
    lines = shown.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith("FAILED ")]
    assert failed == [
        "FAILED test: test_broken (FAIL)",
        "FAILED test: test_parity_x (FAIL)",
        "FAILED bench: (no benchmark json) (FAIL)",
        "FAILED 1-GPU loop: (no loopback-formats.json) (FAIL)",
        "FAILED prefill: (no bench-prefill.json) (FAIL)",
    ]
    assert lines[-len(failed) :] == failed  # the tail of the output
    assert "tests: 2 passed, 2 skipped; 5 failed (tests and checks)" in shown.stdout


def test_a_clean_run_names_nothing_and_exits_0(tmp_path: Path) -> None:
    clean = JUNIT.replace(
        '<testcase classname="t" name="test_broken"><failure message="boom">boom</failure>'
        "</testcase>\n",
        "",
    )
    (tmp_path / "gpu-tests.xml").write_text(clean)
    (tmp_path / "parity-tests.xml").write_text(clean)
    (tmp_path / "bench-nvshmem.skipped").write_text("")
    (tmp_path / "loopback-formats.json").write_text(json.dumps({}))
    (tmp_path / "bench-prefill.json").write_text(json.dumps({"runs": []}))
    shown = _summary(tmp_path)
    assert shown.returncode == 0, shown.stdout
    assert "FAILED" not in shown.stdout
    assert "tests: 2 passed, 2 skipped; 0 failed" in shown.stdout
