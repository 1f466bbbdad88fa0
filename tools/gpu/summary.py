#!/usr/bin/env python3
"""Print the GPU suite's summary table from its JUnit XML and benchmark JSON."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REFERENCE_PEER_COPY_GBS = 394.0
"""One-sided peer copy_ measured on the project's 2xH200 host (ARCHITECTURE.md)."""


def _prefill_outcome(mode: dict[str, Any]) -> str:
    """One mode's tokens/s and TTFT p99, and its per-layer breakdown where it has one (the
    colocated baselines have none: no exchange to split the layer by)."""
    outcome = f"{mode['tokens_per_s']:.0f} tok/s, TTFT p99 {mode['ttft_p99']:.2f} s"
    b = mode.get("breakdown") or {}
    if "compute_ms_per_layer" not in b:
        return outcome
    return (
        f"{outcome}; per layer compute {b['compute_ms_per_layer']:.2f} / dispatch "
        f"{b['dispatch_ms_per_layer']:.2f} / combine {b['combine_ms_per_layer']:.2f} ms"
    )


def main(folder: str) -> int:
    root = Path(folder)
    rows: list[tuple[str, str, str]] = []
    failed = 0
    for name in ("gpu-tests.xml", "parity-tests.xml"):
        xml = root / name
        if not xml.exists():
            rows.append(("test", f"(no {name})", "FAIL"))
            failed += 1
            continue
        for case in ET.parse(xml).getroot().iter("testcase"):
            test = case.get("name", "?")
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "FAIL"
                failed += 1
            elif case.find("skipped") is not None:
                outcome = "skip"
            else:
                outcome = "pass"
            rows.append(("test", test, outcome))
    bench = root / "bench-nvshmem.json"
    if bench.exists():
        report = json.loads(bench.read_text())
        for key, value in report.get("latency_us", {}).items():
            # The <= 5 us target is for arrival as an endpoint sees it (through wait_any);
            # the raw device-side ping-pongs have no host in the loop and no target.
            if key.startswith("wait_any"):
                verdict = "endpoint view; target <= 5 us " + ("met" if value <= 5 else "NOT met")
            else:
                verdict = "raw device-side ping-pong, no host in the loop"
            rows.append(("latency", key, f"{value:.2f} us ({verdict})"))
        for size, r in report.get("bandwidth", {}).items():
            n = int(size)
            gbs = n / r["window"] / 1e9
            label = f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"
            if "peer_copy" in r:
                ratio = r["peer_copy"] / r["window"]
                verdict = ""
                if n >= 16 << 20:
                    verdict = " (target >= 0.90)" if ratio >= 0.9 else " (BELOW the 0.90 target)"
                text = (
                    f"{gbs:.0f} GB/s = {ratio:.2f} of the same-run P2P copy_ floor "
                    f"({n / r['peer_copy'] / 1e9:.0f} GB/s){verdict}; "
                    f"{gbs / REFERENCE_PEER_COPY_GBS:.2f} of {REFERENCE_PEER_COPY_GBS:.0f}"
                )
            else:
                text = f"{gbs:.0f} GB/s = {gbs / REFERENCE_PEER_COPY_GBS:.2f} of the reference"
            rows.append(("bandwidth", label, text))
        spread = report.get("layer_spread", {})
        for key, seconds in report.get("layer", {}).items():
            low, high = spread.get(f"{key}/p10"), spread.get(f"{key}/p90")
            span = f" (p10-p90 {low * 1e3:.2f}-{high * 1e3:.2f})" if low and high else ""
            rows.append(("layer 1A1F", key, f"{seconds * 1e3:.2f} ms{span}"))
    elif (root / "bench-nvshmem.skipped").exists():
        rows.append(("bench", "nvshmem", "skipped: needs two GPUs"))
    else:
        rows.append(("bench", "(no benchmark json)", "FAIL"))
        failed += 1
    formats = root / "loopback-formats.json"
    if formats.exists():
        for name, by_tokens in json.loads(formats.read_text()).items():
            for tokens, r in by_tokens.items():
                rows.append(
                    (
                        "1-GPU loop",
                        f"{name} {tokens} tokens",
                        f"{r['layer_ms_p50']:.3f} ms (p10-p90 {r['layer_ms_p10']:.3f}-"
                        f"{r['layer_ms_p90']:.3f}), {r['bytes'] / 1e6:.1f} MB, dispatch() "
                        f"{r['dispatch_host_us_p50']:.0f} us host; behind compute "
                        f"{r.get('exposed_ms_p50', float('nan')):.3f} ms exposed",
                    )
                )
    else:
        rows.append(("1-GPU loop", "(no loopback-formats.json)", "FAIL"))
        failed += 1
    # stage_attention.py's verdict: a later stage piece's attention (lower-right causal mask)
    # against the boolean mask and the whole prompt; its last line says PASS or FAIL.
    stage_log = root / "stage-attention.log"
    verdicts = [
        line
        for line in (stage_log.read_text().splitlines() if stage_log.exists() else [])
        if line.startswith("stage_attention: ")
    ]
    if verdicts and "PASS" in verdicts[-1]:
        rows.append(("stage attention", "lower-right mask vs boolean and whole", "pass"))
    else:
        why = verdicts[-1] if verdicts else f"(no verdict in {stage_log.name})"
        rows.append(("stage attention", why, "FAIL"))
        failed += 1
    # bench-prefill.json: the main job on 1-2 GPUs; bench-prefill-4gpu.json: the 4-GPU
    # section (issue #17), when the machine had four. Each run names its A:F, split and stages.
    files = sorted(
        root.glob("bench-prefill*.json"), key=lambda f: (f.name != "bench-prefill.json", f.name)
    )
    if not any(f.name == "bench-prefill.json" for f in files):
        rows.append(("prefill", "(no bench-prefill.json)", "FAIL"))
        failed += 1
    for prefill in files:
        tag = prefill.stem.removeprefix("bench-prefill").lstrip("-")
        for entry in json.loads(prefill.read_text())["runs"]:
            layout = f"{entry.get('attention_ranks', '?')}A{entry.get('ffn_ranks', '?')}F"
            share = entry.get("attention_share")
            split = f" A {share} %" if share is not None else ""
            rate = entry.get("rate")
            arrivals = f" {rate:g}/s" if rate is not None else ""
            name = (
                f"{tag + ' ' if tag else ''}{entry['preset']} {entry['workload']} {layout}"
                f"{split}{arrivals}"
            )
            report = entry.get("report")
            if report is None:
                rows.append(("prefill", name, f"FAIL (exit {entry['exit_code']})"))
                failed += 1
                continue
            bad = report["verification_failures"]
            for mode, m in report["modes"].items():
                outcome = "FAIL (outputs)" if mode in bad else _prefill_outcome(m)
                label = f"async N={entry.get('stages', '?')}" if mode == "async" else mode
                rows.append(("prefill", f"{name} {label}", outcome))
                failed += mode in bad
    width = max(len(r[1]) for r in rows)
    print("\nGPU suite summary")
    for kind, name, outcome in rows:
        print(f"  {kind:10s} {name:{width}s}  {outcome}")
    passed = sum(r[2] == "pass" for r in rows)
    skipped = sum(r[2] == "skip" for r in rows)
    print(f"tests: {passed} passed, {skipped} skipped; {failed} failed (tests and checks)")
    # Last, so that a log's tail names them: each failed test or check, and why.
    for kind, name, outcome in rows:
        if outcome.startswith("FAIL"):
            print(f"FAILED {kind}: {name} ({outcome})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/gpu-suite"))
