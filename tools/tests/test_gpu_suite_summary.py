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
        "FAILED stage attention: (no verdict in stage-attention.log) (FAIL)",
        "FAILED prefill: (no bench-prefill.json) (FAIL)",
    ]
    assert lines[-len(failed) :] == failed  # the tail of the output
    assert "tests: 2 passed, 2 skipped; 6 failed (tests and checks)" in shown.stdout


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
    (tmp_path / "stage-attention.log").write_text("| table |\nstage_attention: PASS: agree\n")
    shown = _summary(tmp_path)
    assert shown.returncode == 0, shown.stdout
    assert "FAILED" not in shown.stdout
    assert "tests: 3 passed, 2 skipped; 0 failed" in shown.stdout  # with stage attention


def test_a_failed_stage_attention_check_is_named(tmp_path: Path) -> None:
    clean = (
        JUNIT.replace("test_broken", "test_fine_too")
        .replace("<failure", "<x")
        .replace("</failure>", "</x>")
    )
    (tmp_path / "gpu-tests.xml").write_text(clean)
    (tmp_path / "parity-tests.xml").write_text(clean)
    (tmp_path / "bench-nvshmem.skipped").write_text("")
    (tmp_path / "loopback-formats.json").write_text(json.dumps({}))
    (tmp_path / "bench-prefill.json").write_text(json.dumps({"runs": []}))
    verdict = "stage_attention: FAIL: outputs not finite or apart by 2e-2 or more"
    (tmp_path / "stage-attention.log").write_text(f"| table |\n{verdict}\n")
    shown = _summary(tmp_path)
    assert shown.returncode == 1, shown.stdout
    assert f"FAILED stage attention: {verdict} (FAIL)" in shown.stdout.splitlines()


def test_a_prefill_mode_without_a_breakdown_shows_no_nan(tmp_path: Path) -> None:
    """The colocated baseline has no per-layer breakdown (its report's ``breakdown`` is
    ``{}``, as on the H100 at 353704e): its row gives tokens/s and TTFT alone, where it
    printed ``compute nan / dispatch nan / combine nan``; an AFD mode keeps its split."""
    clean = JUNIT.replace("<failure", "<x").replace("</failure>", "</x>")
    (tmp_path / "gpu-tests.xml").write_text(clean)
    (tmp_path / "parity-tests.xml").write_text(clean)
    (tmp_path / "bench-nvshmem.skipped").write_text("")
    (tmp_path / "loopback-formats.json").write_text(json.dumps({}))
    (tmp_path / "stage-attention.log").write_text("stage_attention: PASS: agree\n")
    split = {"compute_ms_per_layer": 3.42, "dispatch_ms_per_layer": 0.36,
             "combine_ms_per_layer": 0.48}  # fmt: skip
    modes = {
        "async": {"tokens_per_s": 171891.2, "ttft_p99": 0.051, "breakdown": split},
        "colocated": {"tokens_per_s": 276822.4, "ttft_p99": 0.031, "breakdown": {}},
    }
    run = {"preset": "v2-lite", "workload": "uneven", "attention_ranks": 1, "ffn_ranks": 1,
           "stages": 2, "exit_code": 0,
           "report": {"verification_failures": {}, "modes": modes}}  # fmt: skip
    (tmp_path / "bench-prefill.json").write_text(json.dumps({"runs": [run]}))
    shown = _summary(tmp_path)
    assert shown.returncode == 0, shown.stdout
    assert "nan" not in shown.stdout
    rows = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert [row for row in rows if row.startswith("prefill ")] == [
        "prefill v2-lite uneven 1A1F async N=2 171891 tok/s, TTFT p99 0.05 s; per layer "
        "compute 3.42 / dispatch 0.36 / combine 0.48 ms",
        "prefill v2-lite uneven 1A1F colocated 276822 tok/s, TTFT p99 0.03 s",
    ]


def test_the_suite_explains_itself_and_refuses_an_unknown_argument() -> None:
    """``tools/gpu/suite --help`` prints its whole header comment (to its last line, however
    long it grows) and nothing of the script; an unknown argument exits 2 naming it, before
    anything runs (no GPU needed for either)."""
    suite = SUMMARY.with_name("suite")
    header = []
    for line in suite.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header.append(line.removeprefix("#").removeprefix(" "))
    shown = subprocess.run(
        ["bash", str(suite), "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == header
    assert header[0].startswith("Every GPU test and benchmark of afd")
    bad = subprocess.run(["bash", str(suite), "--fast"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "tools/gpu/suite: unknown argument '--fast'" in bad.stderr
