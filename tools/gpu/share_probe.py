"""Which CUDA MPS SM shares write every GEMM output, and does a cuBLAS setting fix the rest?

Why: on one H200 (torch 2.11 + CUDA 13, driver 580) cuBLAS leaves elements of bf16 GEMM
outputs unwritten for a process that is an MPS client at 33, 37, 40 or 75 % of the SMs
(42, 48, 52, 98 SMs), and writes all of them at 25, 50 and 100 % (32, 66, 132 SMs);
``afd_models.check_gemms_write_every_output`` stops a rank on such a share
(docs/benchmarks.md, "The bf16 NaN, found"). So afd run splits a GPU only into those
three shares, and 2A1F in thirds, which ``afd sim`` projects at 1.33x the throughput of
25/25/25 % (docs/sim.md), cannot run. A zero cuBLAS workspace, no reduced-precision
reduction and the cuBLASLt path were tried and changed nothing. No public report of the
fault was found (2026-12-05); the likeliest cause, inferred, is that Hopper kernels with
thread-block clusters or persistent grids plan for the SM count the client sees, which an
MPS share need not be able to schedule as planned.

This starts a private MPS daemon (:class:`afd_transport_nvshmem.mps.MpsDaemon`, stopped on
exit and on failure) and runs one client process per share and setting. Each client reports
the SM count it sees, runs the start-up probe's products
(:func:`afd_models.unwritten_outputs`, bf16 and float32, more row counts than at start-up),
and times one bf16 GEMM (an 8192 x 2048 x 10944 product, TFLOP/s; the setting's speed
cost). The settings other than ``default`` run only at the shares where ``default`` left
outputs unwritten:

``default``          as afd run's ranks run
``lt-target-known``  cuBLASLt preferred, told through torch's SM carveout to plan for the
                     largest SM count seen to write everything (32, 66, 132) that is not
                     above the client's
``lt-no-splitk``     cuBLASLt with split-K off (``allow_bf16_reduced_precision_reduction``
                     ``= (False, False)``)

    python3 tools/gpu/share_probe.py [--shares 25,33,50] [--settings default,lt-target-known]
                                     [--json F]

Prints one table row per (share, setting); exits 0 when every run finished (whatever it
found), 1 when a client failed, 2 on bad arguments or without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_SHARES = (20, 25, 30, 33, 37, 40, 45, 50, 60, 66, 75, 100)
SETTINGS = ("default", "lt-target-known", "lt-no-splitk")
KNOWN_GOOD_SMS = (32, 66, 132)
"""SM counts whose clients wrote every GEMM output on an H200 (25, 50, 100 %)."""
ROWS = (1, 9, 33, 49, 100, 257, 510, 1024, 2049, 4096, 8192)
"""Row counts of the probe products (the start-up probe's, and larger prefill batches)."""
CLIENT_TIMEOUT_S = 180.0
ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "packages" / p / "src" for p in ("afd-protocol", "afd-transport-nvshmem",
           "afd-models")] + [ROOT / "tools" / "src"]  # fmt: skip
"""Run from the source tree: the packages it imports, for this process and its clients."""


@dataclass(frozen=True)
class Finding:
    """One client's answer: what it saw and what its GEMMs left unwritten."""

    share: int
    setting: str
    sms: int | None = None
    planned_sms: int | None = None
    """The SM count cuBLASLt was told to plan for (None: the library's own choice)."""
    unwritten: int | None = None
    """Probe products that left elements unwritten."""
    products: int | None = None
    first: str | None = None
    """The first such product, as the probe names it."""
    tflops: float | None = None
    error: str | None = None
    """Why the client gave no answer (its last stderr line), or None."""

    @property
    def writes_everything(self) -> bool:
        return self.error is None and self.unwritten == 0


def parse_shares(text: str) -> tuple[int, ...]:
    """``"25,33,50"`` -> ``(25, 33, 50)``; each 1 to 100 (argparse type)."""
    try:
        shares = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shares takes percentages separated by commas, e.g. 25,33,50; got {text!r}"
        ) from None
    bad = [s for s in shares if not 1 <= s <= 100]
    if not shares or bad:
        raise argparse.ArgumentTypeError(
            f"--shares takes percentages of 1 to 100; got {text!r}"
            + (f" ({', '.join(map(str, bad))} out of range)" if bad else "")
        )
    return shares


def parse_settings(text: str) -> tuple[str, ...]:
    """``"default,lt-target-known"`` -> the names, each one of :data:`SETTINGS`."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in SETTINGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--settings takes some of {', '.join(SETTINGS)}; got {text!r}"
        )
    return names


def planned_sms(setting: str, seen: int) -> int | None:
    """The SM count ``setting`` tells cuBLASLt to plan for on a client seeing ``seen``
    (never more than it sees; None: the library's own choice)."""
    if setting == "lt-target-known":
        return max((n for n in KNOWN_GOOD_SMS if n <= seen), default=seen)
    return None


def table(findings: Sequence[Finding]) -> str:
    """The findings as a markdown table, one row each, in the order given."""
    lines = [
        "| share % | SMs seen | setting | SMs planned | unwritten products | first unwritten | "
        "bf16 TFLOP/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in findings:
        if f.error is not None:
            lines.append(f"| {f.share} | - | {f.setting} | - | failed: {f.error} | - | - |")
            continue
        planned = "-" if f.planned_sms is None else str(f.planned_sms)
        tflops = "-" if f.tflops is None else f"{f.tflops:.0f}"
        lines.append(
            f"| {f.share} | {f.sms} | {f.setting} | {planned} | {f.unwritten} of {f.products} | "
            f"{f.first or '-'} | {tflops} |"
        )
    return "\n".join(lines)


def finding_from(share: int, setting: str, completed: subprocess.CompletedProcess[str]) -> Finding:
    """Read one client's JSON line (its last line of stdout); a failure keeps stderr's last
    line as the reason."""
    lines = completed.stdout.strip().splitlines()
    if completed.returncode == 0 and lines:
        try:
            data = json.loads(lines[-1])
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            return Finding(share=share, setting=setting, **data)
    said = (completed.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
    return Finding(share, setting, error=f"exit {completed.returncode}: {said}")


def _client(setting: str) -> dict[str, Any]:
    """In a client process: apply ``setting``, probe, time; the JSON fields of a Finding."""
    import torch

    from afd_models.gemm_check import PROBE_SHAPES, unwritten_outputs

    device = torch.device("cuda", 0)
    seen = torch.cuda.get_device_properties(device).multi_processor_count
    plan = planned_sms(setting, seen)
    if setting != "default":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    if plan is not None:
        getattr(torch._C, "_set_sm_carveout_experimental")(seen - plan)  # noqa: B009 -- private
    if setting == "lt-no-splitk":
        matmul: Any = torch.backends.cuda.matmul
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
    dtypes = (torch.bfloat16, torch.float32)
    found = unwritten_outputs(device, PROBE_SHAPES, ROWS, dtypes)
    a = torch.randn(8192, 2048, device=device, dtype=torch.bfloat16)
    b = torch.randn(2048, 10944, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / 20
    return {
        "sms": seen,
        "planned_sms": plan,
        "unwritten": len(found),
        "products": len(PROBE_SHAPES) * len(ROWS) * len(dtypes),
        "first": found[0] if found else None,
        "tflops": 2 * 8192 * 2048 * 10944 / seconds / 1e12,
    }


def _run_client(share: int, setting: str, env: dict[str, str]) -> Finding:
    command = [sys.executable, str(Path(__file__).resolve()), "--client", setting]
    try:
        completed = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return Finding(share, setting, error=f"no answer within {CLIENT_TIMEOUT_S:.0f} s")
    return finding_from(share, setting, completed)


def probe(
    shares: Sequence[int], settings: Sequence[str], control: str | None = None
) -> list[Finding]:
    """Every share with ``default`` first, then the other settings where it failed;
    ``control``: the MPS control program (default: found on ``PATH``)."""
    from afd_transport_nvshmem.mps import MpsDaemon

    findings: list[Finding] = []
    with MpsDaemon.start(control=control) as daemon:
        for share in shares:
            env = {**os.environ, **daemon.client_environment(share)}
            first = _run_client(share, "default", env) if "default" in settings else None
            if first is not None:
                findings.append(first)
                print(table([first]).splitlines()[-1], flush=True)
                if first.writes_everything:
                    continue
            for setting in settings:
                if setting == "default":
                    continue
                finding = _run_client(share, setting, env)
                findings.append(finding)
                print(table([finding]).splitlines()[-1], flush=True)
    return findings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring for the settings."
    )
    parser.add_argument(
        "--shares",
        type=parse_shares,
        default=DEFAULT_SHARES,
        help="MPS active-thread percentages to probe (default: %(default)s)",
    )
    parser.add_argument(
        "--settings",
        type=parse_settings,
        default=SETTINGS,
        help=f"cuBLAS settings, of {', '.join(SETTINGS)} (default: all)",
    )
    parser.add_argument("--json", type=Path, help="write every finding here")
    parser.add_argument("--client", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path[:0] = [str(p) for p in SOURCES]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in SOURCES] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    )
    if args.client is not None:
        print(json.dumps(_client(args.client)), flush=True)
        return 0
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {args.json} is a directory; give a file name")
    import torch

    if not torch.cuda.is_available():
        print("tools/gpu/share_probe.py: needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    print("\n".join(table([]).splitlines()), flush=True)
    started = time.monotonic()
    findings = probe(args.shares, args.settings)
    print(f"\n{table(findings)}\n\n{len(findings)} clients in {time.monotonic() - started:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(f) for f in findings], indent=1) + "\n")
    return 1 if any(f.error is not None for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
