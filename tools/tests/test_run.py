"""`afd run` end to end: real processes, verified outputs, report, JSON, plot, faults."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from afd_protocol.shm import leftover_segments, segment_prefix
from afd_tools.cli import main
from afd_tools.run.verify import TIE_MARGIN

SMALL = [
    "run",
    "--device",
    "cpu",
    "--requests",
    "8",
    "--max-prompt-len",
    "48",
    "--max-num-batched-tokens",
    "64",
    "--no-progress",
]


def test_all_modes_verify_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, plot = tmp_path / "run.json", tmp_path / "run.png"
    before = set(leftover_segments())
    assert main([*SMALL, "--json", str(report), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "PASS: every request's final hidden state matches" in out
    assert "async/sync tokens/s" in out
    took = re.search(
        r"; (\d+) s \(start-up and warm-up ([\d.]+) s \[per replica: processes and transport "
        r"([\d.]+) s, model ([\d.]+) s, warm-up ([\d.]+) s\], modes ([\d.]+) s, stop ([\d.]+) s, "
        r"verification ([\d.]+) s \[(.*)\]\)$",
        out.strip().splitlines()[-1],
    )
    assert took is not None, out.strip().splitlines()[-1]
    *figures, parts = took.groups()
    total, start, processes, model, warm_up, *phases = (float(v) for v in figures)
    # The verification's parts: the reference built here, replayed, the exchanges checked;
    # together no more than its total (each rounded to 0.1 s).
    seconds = [float(v) for v in re.findall(r" ([\d.]+) s(?:, |$)", parts)]
    assert parts.startswith("reference built "), parts
    assert " replay" in parts, parts
    assert "exchanges of " in parts, parts
    assert sum(seconds) <= phases[-1] + 0.05 * len(seconds) + 0.05, parts
    assert start + sum(phases) <= total + 1.0  # each rounded to 0.1 s, the total to 1 s
    assert start > 0.0  # the ranks take time to start
    assert processes > 0.0  # spawning and importing take time; a tiny model may round to 0
    assert min(model, warm_up) >= 0.0
    # Every mode begins at a barrier, after every replica's warm-up: the split is inside.
    assert processes + model + warm_up <= start + 0.3
    data = json.loads(report.read_text())
    assert set(data["modes"]) == {"async", "sync", "colocated"}
    prompt_tokens = sum(r["prompt_len"] for r in data["requests"])
    replicas = data["deployment"]["attention_ranks"]
    for mode, summary in data["modes"].items():
        assert summary["tokens_per_s"] > 0
        assert 0 <= summary["ttft_p50"] <= summary["ttft_p99"]
        # Every step's record: its tokens (sync adds one-token dummy batches), its
        # dispatches (the breakdown's MoE layers, summed over the replicas), its compute.
        steps = summary["attention_steps"]
        tokens = sum(step[0] for step in steps)
        assert tokens == prompt_tokens if mode != "sync" else tokens >= prompt_tokens
        dispatches = sum(step[2] for step in steps)
        layers = summary["breakdown"].get("moe_layers", 0.0) * replicas
        assert dispatches == pytest.approx(layers), mode
        assert all(step[3] > 0 for step in steps), mode
        assert sum(step[3] for step in steps) <= replicas * summary["makespan_s"], mode
    assert data["verification_failures"] == {}
    for mode in ("async", "sync", "colocated"):  # float32: exact, so nothing to follow
        assert data["verification_near_ties"][mode]["followed"] == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(leftover_segments()) <= before


def test_shared_experts_on_ffn_in_bf16_with_poisson_arrivals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        *SMALL,
        "--mode",
        "async",
        "--shared",
        "ffn",
        "--dtype",
        "bfloat16",
        "--rate",
        "200",
        "--assign",
        "least-tokens",
    ]
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out


def _strict_json(text: str) -> Any:
    """``json.loads`` refusing NaN and Infinity, which Python's own reader accepts."""

    def refuse(name: str) -> None:
        raise ValueError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


ONE_PAIR = [*SMALL, "--attention-ranks", "1", "--ffn-ranks", "1", "--mode", "async"]
"""One replica, one FFN rank, async only: the cheapest run that goes through the exchange."""


def test_a_planted_wrong_expert_and_a_nan_fail_naming_request_mode_and_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica sends one token to a far-from-tied expert at the last layer (its final
    state unchanged: only the routing check can see it) and returns a NaN for another
    request: both fail, by name, and the JSON stays valid."""
    import afd_run_plants

    from afd_tools.run import ranks

    monkeypatch.setattr(ranks, "attention_replica", afd_run_plants.wrong_expert_and_nan_replica)
    report = tmp_path / "run.json"
    assert main([*ONE_PAIR, "--json", str(report)]) == 1
    out = capsys.readouterr().out
    fail = next(line for line in out.splitlines() if line.startswith("FAIL: "))
    assert "async: request 0 (wrong expert at layer 2: token 0 went to experts " in fail
    assert "request 1 (not finite: the run's output holds 1 NaN and 0 inf of 64 values)" in fail
    data = _strict_json(report.read_text())
    assert data["verification_failures"] == {"async": [0, 1]}
    assert data["verification_errors"]["async"]["1"] is None
    assert data["verification_reasons"]["async"]["1"].startswith("not finite: the run's output")


def _layer_one_fault_fails_every_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reason: str
) -> dict[str, Any]:
    """Run ONE_PAIR in bf16 with a fault planted at the first MoE layer (already patched
    in): it fails every request with ``reason`` (the start of each one's reason), while
    some final states alone are within the tolerance; returns the JSON report."""
    report = tmp_path / "run.json"
    assert main([*ONE_PAIR, "--dtype", "bfloat16", "--json", str(report)]) == 1
    fail = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL"))
    assert reason in fail
    data: dict[str, Any] = _strict_json(report.read_text())
    failed = data["verification_failures"]["async"]
    assert len(failed) == 8  # every request: each chunk's probed tokens go through layer 1
    reasons = data["verification_reasons"]["async"]
    for rid in failed:
        assert reasons[str(rid)].startswith(reason), reasons
    within = [r for r in failed if data["verification_errors"]["async"][str(r)] <= 2e-2]
    assert within, data["verification_errors"]  # the final states alone would have passed
    return data


def test_a_wrong_exchange_at_one_layer_fails_though_the_final_states_are_within_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FFN rank's replies at the first MoE layer are 3 % too large (every other layer
    right): in bf16 the requests' final states stay within the 2e-2 tolerance, but the
    exchange, checked layer by layer at up to 8 tokens of each chunk, fails by name."""
    import afd_run_plants

    from afd_tools.run import ranks

    monkeypatch.setattr(ranks, "ffn_rank", afd_run_plants.scaled_exchange_ffn_rank)
    data = _layer_one_fault_fails_every_request(
        tmp_path, capsys, "the MoE exchange at layer 1 returned token "
    )
    worst = data["verification_exchanges"]["async"]
    assert worst["layer"] == 1
    assert 2e-2 < worst["worst"] < 4e-2  # the planted 3 %, give or take one layer's rounding


def test_weights_sent_off_at_one_layer_fail_though_the_exchange_and_final_states_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica's expert weights at the first MoE layer are 1 % too large (a wrong
    routed scale on the attention side, half the bf16 tolerance): the FFN rank returns
    exactly what it was asked for, and in bf16 the final states stay within the tolerance,
    but the weights, checked against the reference's router on the rows the replica sent
    to 1e-4, fail by name."""
    import afd_run_plants

    from afd_tools.run import ranks

    monkeypatch.setattr(ranks, "attention_replica", afd_run_plants.scaled_weights_replica)
    data = _layer_one_fault_fails_every_request(
        tmp_path, capsys, "the MoE exchange at layer 1 weighted token "
    )
    exchanges = data["verification_exchanges"]["async"]
    assert exchanges["worst"] <= 2e-2  # the FFN side did what it was told
    assert 0.9e-2 < exchanges["weights_worst"] < 1.1e-2  # the planted 1 %
    assert exchanges["router_wrong"] == 0


def test_bf16_near_ties_where_run_and_reference_differ_pass_and_are_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica's norms round differently (``afd_run_plants.drifted_replica``), so its
    router, right on its own states, flips decisions the reference makes at near ties on
    its states: the reference follows them, the run passes, and the flips are counted."""
    import afd_run_plants

    from afd_tools.run import ranks

    monkeypatch.setattr(ranks, "attention_replica", afd_run_plants.drifted_replica)
    report = tmp_path / "run.json"
    argv = [*ONE_PAIR, "--dtype", "bfloat16", "--requests", "16", "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS: every request's final hidden state matches" in out
    data = _strict_json(report.read_text())
    # One replica: its steps' records add up to its breakdown exactly.
    summary = data["modes"]["async"]
    steps, breakdown = summary["attention_steps"], summary["breakdown"]
    assert sum(step[2] for step in steps) == breakdown["moe_layers"]
    compute = breakdown["compute_ms_per_layer"] * breakdown["moe_layers"] / 1e3
    assert sum(step[3] for step in steps) == pytest.approx(compute, rel=1e-9)
    ties = data["verification_near_ties"]["async"]
    assert ties["followed"] >= 1, ties
    assert ties["decisions"] >= ties["followed"]
    assert f"async {ties['decisions']} ({ties['followed']} followed, largest gap " in out
    assert 0 < ties["largest_followed_gap"] <= TIE_MARGIN["bfloat16"]


def test_the_drift_margin_is_asked_for_on_the_command_line_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--tie-margin-from drift`` reaches verification: a replica whose states drift
    (``afd_run_plants.drifted_replica``) shows that drift at its probed tokens, so the
    margin it measures passes every decision the reference followed, and the report says
    which margin judged, per layer, never above the depth margin."""
    import afd_run_plants

    from afd_tools.run import ranks

    monkeypatch.setattr(ranks, "attention_replica", afd_run_plants.drifted_replica)
    report = tmp_path / "run.json"
    argv = [*ONE_PAIR, "--dtype", "bfloat16", "--requests", "16", "--tie-margin-from", "drift",
            "--json", str(report)]  # fmt: skip
    assert main(argv) == 0
    assert "PASS: every request's final hidden state matches" in capsys.readouterr().out
    ties = _strict_json(report.read_text())["verification_near_ties"]["async"]
    assert ties["tie_margin_from"] == "drift"
    assert ties["followed"] >= 1
    assert ties["drift_rejected"] == 0
    assert ties["smallest_drift_margin_to_gap"] >= 1
    assert ties["drift_probes"] > 0
    assert ties["drift_unmeasured_layers"] == []
    assert all(math.isfinite(d) and d > 0 for d in ties["drift_by_layer"].values())
    margins = list(ties["drift_margin_by_layer"].values())
    assert margins
    assert all(2.0**-8 <= m <= TIE_MARGIN["bfloat16"] for m in margins)  # 4 layers: <= depth
    assert min(margins) < TIE_MARGIN["bfloat16"]  # measured, tighter than the depth margin
    assert ties["within_drift_margin"] <= ties["all_decisions"]


def test_a_router_that_flips_near_ties_itself_fails_the_layer_local_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica's router takes its (k+1)-th expert wherever its own scores are within a
    quarter of the bf16 tie margin: the end-to-end check would follow every such flip,
    but at up to 8 tokens of each chunk the reference's router sees the same row and holds the
    choice to one layer's rounding (``LAYER_TIE_MARGIN``), so the requests where a flip
    landed on such a row fail by name."""
    import afd_run_plants

    from afd_tools.run import ranks

    monkeypatch.setattr(ranks, "attention_replica", afd_run_plants.near_tie_replica)
    report = tmp_path / "run.json"
    argv = [*ONE_PAIR, "--dtype", "bfloat16", "--requests", "16", "--json", str(report)]
    assert main(argv) == 1
    assert "FAIL" in capsys.readouterr().out
    data = _strict_json(report.read_text())
    reasons = data["verification_reasons"]["async"]
    assert reasons
    for reason in reasons.values():
        assert reason.startswith("the router on a dispatched row: wrong expert at layer "), reason
    assert data["verification_exchanges"]["async"]["router_wrong"] >= len(reasons)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rate", "-2"], "--rate must be a positive number of requests per second, got -2.0"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
        (["--max-prompt-len", "0"], "--max-prompt-len must be >= 1, got 0"),
        (
            ["--json", "/nonexistent-dir/run.json"],
            "cannot write /nonexistent-dir/run.json: the directory /nonexistent-dir does not exist",
        ),
        (["--plot", "."], ". is a directory; give a file name to write to"),
        (["--transport", "nvshmem"], "--transport nvshmem needs --device cuda"),
        (
            ["--transport", "bogus"],
            "unknown transport 'bogus'; the installed ones are: shm, nvshmem, cam-emulator",
        ),
        (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
        (["--stages", "0"], "--stages must be >= 1, got 0"),
        (
            ["--min-stage-tokens", "-1"],
            "--min-stage-tokens must be >= 0 (0: always --stages), got -1",
        ),
        (["--tie-margin", "nan"], "--tie-margin must be within [0, 1], got nan"),
        (
            ["--cam-dynamic-quant"],
            "--cam-dynamic-quant applies to --transport cam-emulator only",
        ),
        (
            ["--exchange-graphs", "4"],
            "--exchange-graphs applies to --transport nvshmem only; drop it for --transport shm",
        ),
        (
            ["--ffn-graph", "--backend", "triton"],
            "--ffn-graph applies to --transport nvshmem only (the serve loop's kernels); drop it "
            "for --transport shm",
        ),
        (
            ["--peer-puts"],
            "--peer-puts applies to --transport nvshmem only; drop it for --transport shm",
        ),
        (
            ["--peer-puts", "--ffn-graph"],
            "--ffn-graph stores replies straight into the attention ranks' windows, which "
            "--peer-puts does not map; drop one of them",
        ),
        (
            ["--exchange-graphs", "-1"],
            "--exchange-graphs is how many token counts to hold as CUDA graphs (0: none), got -1",
        ),
        (
            ["--transport", "cam-emulator", "--shared", "ffn"],
            "--transport cam-emulator needs --shared attention",
        ),
        (
            ["--transport", "cam-emulator", "--ffn-ranks", "3"],
            "--transport cam-emulator: CAM's operators place expert e on FFN rank e // R: the "
            "8 experts must split evenly and contiguously over the 3 FFN ranks (got (3, 3, 2) "
            "per rank)",
        ),
    ],
)
def test_configuration_errors_are_one_line_before_anything_runs(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*SMALL, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"afd run: error: {message}"]
    assert "afd run: 2 attention" not in captured.out  # refused before launching anything


def test_colocated_dp_ep_exchanges_tokens_between_all_processes_and_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Colocated DP+EP on the A+F processes AFD uses (gloo collectives on CPU), beside async
    AFD with two token-level stages, every output verified. The shared experts run on the
    FFN ranks in AFD and on every process in DP+EP: each mode's exchange is checked against
    what it carries."""
    report = tmp_path / "ep.json"
    argv = [*SMALL, "--colocated", "dp-ep", "--stages", "2", "--shared", "ffn"]
    argv += ["--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "; colocated: DP4+EP over gloo" in out
    assert "PASS: every request's final hidden state matches" in out
    data = json.loads(report.read_text())
    assert data["verification_failures"] == {}
    assert set(data["verification_worst"]) == {"async", "sync", "colocated"}
    exchanges = data["verification_exchanges"]
    assert set(exchanges) == {"async", "sync", "colocated"}
    assert all(e["rows"] > 0 and e["worst"] <= 1e-5 for e in exchanges.values()), exchanges
    colocated = data["modes"]["colocated"]
    assert len(colocated["attention_busy"]) == 4  # every process computes attention
    assert colocated["ffn_busy"] == []
    assert data["placement"]["exchange"] == "gloo"


def test_a_stage_floor_above_every_step_runs_async_in_one_stage(tmp_path: Path) -> None:
    """--stages 2 --min-stage-tokens 1000 on steps of at most 64 tokens: every step stays
    whole, so the attention rank dispatches exactly as many MoE layers as with --stages 1
    (the breakdown's count, not the FFN items, which are counted by a time window) and the
    outputs verify; the report records the floor."""
    items = {}
    for name, extra in {
        "floor": ["--stages", "2", "--min-stage-tokens", "1000"],
        "one": ["--stages", "1"],
        "two": ["--stages", "2"],
    }.items():
        report = tmp_path / f"{name}.json"
        assert main([*SMALL, "--mode", "async", *extra, "--json", str(report)]) == 0
        data = json.loads(report.read_text())
        assert data["verification_failures"] == {}
        items[name] = data["modes"]["async"]["breakdown"]["moe_layers"]
        floor = 1000 if name == "floor" else 0
        assert data["deployment"]["min_stage_tokens"] == floor
    assert items["floor"] == items["one"]
    assert items["two"] > items["one"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_warm_pass_runs_every_request_once_untimed_and_uncounted(
    tmp_path: Path, mode: str
) -> None:
    """--warm-pass on (two replicas, so sync's lockstep runs the pass too): the outputs
    verify, the report records the pass, and the mode counts exactly the MoE layers and
    requests a run without the pass does (the pass's are not in it)."""
    runs = {}
    for warm in ("on", "off"):
        report = tmp_path / f"{warm}.json"
        argv = [*SMALL, "--attention-ranks", "2", "--mode", mode, "--stages", "2"]
        assert main([*argv, "--warm-pass", warm, "--json", str(report)]) == 0
        runs[warm] = json.loads(report.read_text())
        assert runs[warm]["verification_failures"] == {}
        assert runs[warm]["deployment"]["warm_pass"] is (warm == "on")
    on, off = (runs[w]["modes"][mode] for w in ("on", "off"))
    assert on["breakdown"]["moe_layers"] == off["breakdown"]["moe_layers"]
    assert len(on["ttft_s"]) == len(off["ttft_s"]) == 8


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the message without a GPU"
)
def test_asking_for_cuda_without_a_gpu_says_what_to_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [arg for arg in SMALL if arg not in ("--device", "cpu")]
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "afd run: error: --device cuda: torch sees no CUDA GPU (a CPU build of torch, or no "
        "driver); use --device cpu"
    )


@pytest.mark.parametrize("quant", [False, True])
def test_every_mode_runs_over_the_cam_emulator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quant: bool
) -> None:
    """The main job over the emulated CAM operators: replicas of one rank, CAM's own wire
    format, verified against the monolithic model (int8 dispatch to its looser bound)."""
    report = tmp_path / "cam.json"
    before = set(leftover_segments())
    extra = ["--cam-dynamic-quant"] if quant else []
    argv = [*SMALL, "--transport", "cam-emulator", *extra, "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"(tolerance {'5e-02' if quant else '1e-05'}; worst " in out
    assert json.loads(report.read_text())["verification_failures"] == {}
    assert set(leftover_segments()) <= before


def test_prompts_longer_than_the_budget_are_prefilled_in_chunks_in_every_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prompts of 1x, 2.5x and 8x the budget mixed with short ones: each is prefilled over
    several steps and every final hidden state still matches the unchunked reference."""
    budget = 16
    workload = tmp_path / "long.jsonl"
    lengths = [budget, 3, budget * 5 // 2, 1, budget * 8, 7]
    workload.write_text("".join(json.dumps({"prompt_len": n}) + "\n" for n in lengths))
    report = tmp_path / "run.json"
    argv = [
        "run",
        "--device",
        "cpu",
        "--workload-file",
        str(workload),
        "--max-num-batched-tokens",
        str(budget),
        "--no-progress",
        "--json",
        str(report),
    ]
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["verification_failures"] == {}
    assert set(data["modes"]) == {"async", "sync", "colocated"}


def test_a_budget_of_one_token_works_and_given_tokens_are_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = tmp_path / "tokens.jsonl"
    workload.write_text('{"prompt_tokens": [5, 17, 3]}\n{"prompt_len": 2}\n')
    argv = [
        "run",
        "--device",
        "cpu",
        "--workload-file",
        str(workload),
        "--max-num-batched-tokens",
        "1",
        "--mode",
        "async",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out


def _session(sid: int) -> dict[int, str]:
    """Processes of session ``sid`` (pid -> name), wherever they were reparented to."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found[int(entry.name)] = comm
    return found


def _shm_entries() -> set[str]:
    """This test run's afd segments (its namespace: a test run beside this one has its
    own, so its segments are not counted here)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if p.name.startswith(segment_prefix())}


def _semaphores_mapped(pids: Iterable[int]) -> dict[int, list[str]]:
    """POSIX semaphores (``/dev/shm/sem.*``) that these processes have mapped: a process
    using one maps it, so this attributes them to afd's processes exactly, whatever else
    runs on the machine (a name in /dev/shm could be anyone's)."""
    found: dict[int, list[str]] = {}
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue  # it exited
        names = sorted(
            {
                line[line.index("/dev/shm/sem.") :]
                for line in maps.splitlines()
                if "/dev/shm/sem." in line
            }
        )
        if names:
            found[pid] = names
    return found


def _wait_for(condition, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Poll ``condition()`` until it holds; returns the seconds it took (a hang fails)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what} within {timeout:g} s"
        time.sleep(0.05)
    return time.monotonic() - start


def _as_from_a_terminal() -> None:
    """In the child before ``exec``: Ctrl-C's default action, as a shell gives a command
    it starts in the foreground. A background job of a non-interactive shell (a CI step
    started with ``&``) has SIGINT ignored, and an ignored signal stays ignored across
    ``exec``, so without this the SIGINT tests would test the CI's shell."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


CONSOLE_SCRIPT = "import sys; from afd_tools.cli import main; sys.exit(main())"
"""The ``afd`` console script's call (its ``main()``), given to ``python -c`` so that there
is no main module: multiprocessing imports a ``-m`` module or a script file again, as
``__mp_main__``, in every process it starts, so each of the four ranks would import the
whole CLI a second time -- about 0.7 s of CPU per rank before ``afd sim``'s scipy became a
lazy import, spent before the ranks attach and so on nothing these tests check.
``python -m afd_tools.cli`` itself is run by test_cli.py."""


class RunningRun:
    """``afd run`` in a session of its own, with its own temporary directory."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        argv = [
            sys.executable,
            "-c",
            CONSOLE_SCRIPT,
            *SMALL,
            "--requests",
            "400",
            "--rate",
            "40",
            "--timeout",
            "20",
            *extra,  # a later --rate wins
        ]
        self.shm_before = _shm_entries()
        env = {**os.environ, "TMPDIR": str(self.tmp)}
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=_as_from_a_terminal,
        )
        self.sid = self.process.pid

    def wait_until_every_rank_attached(self) -> None:
        """Synchronise on state: all four ranks have mapped their peers' windows."""

        def attached() -> bool:
            return len(list(self.tmp.glob("afd-rendezvous-*/afd%2Fattached%2F*.kv"))) == 4

        _wait_for(attached, 120, "every rank attached")
        # afd creates no semaphore (results, lockstep and progress go through pipes), so a
        # crash can leave none behind: none of the run's processes has one mapped.
        assert _semaphores_mapped(_session(self.sid)) == {}

    def assert_nothing_left(self, timeout: float = 10.0) -> float:
        took = _wait_for(lambda: not _session(self.sid), timeout, "every process of the run gone")
        assert _shm_entries() <= self.shm_before, _shm_entries() - self.shm_before
        assert list(self.tmp.iterdir()) == [], list(self.tmp.iterdir())
        return took

    def close(self) -> None:
        for pid in _session(self.sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGINT to the process group"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_no_rank_or_file_outlives_the_launcher(tmp_path: Path, how: str, mode: str) -> None:
    """Requests arrive one every 20 s on average, so the ranks are idle, waiting -- the
    state in which an orphan would otherwise wait for its next request (38 s later here)."""
    run = RunningRun(tmp_path, "--mode", mode, "--rate", "0.05")
    try:
        run.wait_until_every_rank_attached()
        if how == "SIGKILL":
            os.kill(run.process.pid, signal.SIGKILL)
        elif how == "SIGTERM":
            os.kill(run.process.pid, signal.SIGTERM)
        else:
            os.killpg(run.sid, signal.SIGINT)
        run.process.wait(timeout=60)
        run.assert_nothing_left()
        if how != "SIGKILL":
            _, err = run.process.communicate()
            assert "interrupted; every rank process was stopped" in err, err
            assert run.process.returncode == 130
    finally:
        run.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("victim", "sig", "said"),
    [
        ("afd-ffn1", signal.SIGKILL, "ffn rank 1: killed by SIGKILL"),
        ("afd-ffn1", signal.SIGTERM, "ffn rank 1: stopped by SIGTERM"),
        ("afd-attn0", signal.SIGTERM, "attention rank 0: stopped by SIGTERM"),
    ],
)
def test_a_signalled_rank_stops_the_run_named_first_and_leaves_nothing_behind(
    tmp_path: Path, victim: str, sig: signal.Signals, said: str
) -> None:
    """The one-line error starts with the rank that got the signal (the cause), before its
    peers' PeerAborted (the consequence); SIGTERM runs the rank's handler, which unwinds
    it, so it is named as a signal and not as the SystemExit the handler raised."""
    run = RunningRun(tmp_path, "--mode", "async")
    try:
        run.wait_until_every_rank_attached()
        pid = next(pid for pid, name in _session(run.sid).items() if name == victim)
        os.kill(pid, sig)
        _, err = run.process.communicate(timeout=60)
        assert run.process.returncode == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert re.match(rf"afd run: error: \d of 4 ranks failed: {said}(;|$)", lines[0]), err
        assert "SystemExit" not in err
        assert "Traceback" not in err
        run.assert_nothing_left()
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_a_killed_replica_in_sync_mode_is_reported_at_once_not_after_the_grace(
    tmp_path: Path,
) -> None:
    """The lockstep checks the other replicas' liveness: the survivor fails by itself,
    naming the dead replica, instead of sitting in the barrier until it is killed."""
    run = RunningRun(tmp_path, "--mode", "sync")
    try:
        run.wait_until_every_rank_attached()
        victim = next(pid for pid, name in _session(run.sid).items() if name == "afd-attn1")
        os.kill(victim, signal.SIGKILL)
        _, err = run.process.communicate(timeout=60)
        assert "attention rank 1: killed by SIGKILL" in err
        assert "attention rank 0: PeerAborted" in err, err
        run.assert_nothing_left()
    finally:
        run.close()
