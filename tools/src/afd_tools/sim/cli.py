"""``afd sim``, ``afd sim calibrate`` and ``afd sim sweep``: options and output."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from afd_models import PRESET_NAMES, preset
from afd_tools.outputs import check_writable, write_atomically
from afd_tools.prefill.metrics import ModeSummary, ratios
from afd_tools.prefill.options import add_wire_options, add_workload_options
from afd_tools.prefill.report import print_report
from afd_tools.prefill.report import write_plot as write_timeline
from afd_tools.prefill.workload import (
    WorkloadError,
    arrival_times,
    assign,
    prompt_lengths,
    read_workload,
)
from afd_tools.sim import calibrate as calibration_fit
from afd_tools.sim import costs, measured
from afd_tools.sim import sweep as sweeping
from afd_tools.sim import validate as validation
from afd_tools.sim.costs import Calibration, SimError, Wire
from afd_tools.sim.measured import read_runs
from afd_tools.sim.modes import COLOCATED, MODES
from afd_tools.sim.simulate import deployment, simulate

DEFAULT_CALIBRATION = "cpu-tiny"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate A attention replicas x F FFN ranks from calibrated per-layer costs",
        description=(
            "A discrete-event model of async AFD, sync AFD and colocated serving: the same "
            "workloads, batching and report as `afd run`, with per-layer costs from a "
            "calibration file instead of real ranks. `afd sim calibrate` makes a calibration "
            "from measurements; `afd sim sweep` explores A:F ratios and GPU counts. What the "
            "model assumes and ignores: docs/sim.md. Its figures beyond measured "
            "configurations are projections."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _model_options(p)
    p.add_argument("--attention-ranks", type=int, default=2, help="attention DP replicas (A)")
    p.add_argument("--ffn-ranks", type=int, default=2, help="FFN ranks (F)")
    p.add_argument("--mode", choices=[*MODES, "all"], default="all", help="which modes")
    p.add_argument(
        "--colocated",
        choices=COLOCATED,
        default=None,
        help="the colocated baseline: dp = each of the A replicas computes the whole model; "
        "dp-ep = A+F ranks with attention and 1/(A+F) of the experts, all_gather + "
        "reduce_scatter per MoE layer (default: dp for a cpu calibration, as afd run on "
        "cpu; dp-ep otherwise)",
    )
    _workload_options(p)
    _deployment_options(p)
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG timeline here")
    p.set_defaults(handler=run_sim)
    kinds = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    _calibrate_parser(kinds)
    _sweep_parser(kinds)
    _validate_parser(kinds)
    _bundle_parser(kinds)


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calibration",
        default=DEFAULT_CALIBRATION,
        help=f"a calibration file, or a shipped one by name ({', '.join(costs.SHIPPED)})",
    )
    p.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default=None,
        help="model shapes (default: the calibration's)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="override the preset's layer count (default: the calibration's)",
    )
    p.add_argument(
        "--any-preset",
        action="store_true",
        help="allow shapes or a layer count other than the calibration's (its per-layer "
        "costs then no longer describe the model: a what-if, not a prediction)",
    )
    p.add_argument(
        "--cores",
        type=float,
        default=None,
        help="processors the ranks share (default: the calibration's; a cpu calibration "
        "fits it, a GPU one has none: every rank has its own GPU)",
    )
    p.add_argument(
        "--sync-barrier",
        choices=("host", "device"),
        default=None,
        help="where sync mode's per-layer barrier is: host = afd run's on a GPU (the host "
        "reaches it having only launched the layers before the dispatch, so the attention "
        "still overlaps the wait), device = after the attention has been computed (a "
        "strict lockstep; afd run's on the CPU) (default: the calibration's)",
    )


def _workload_options(p: argparse.ArgumentParser) -> None:
    add_workload_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")


def _deployment_options(p: argparse.ArgumentParser) -> None:
    add_wire_options(p)
    p.add_argument(
        "--ffn-batch",
        type=int,
        default=1,
        help="ready work items of one layer an FFN rank serves in one grouped GEMM (afd run "
        "serves 1; more is a what-if: each extra item costs the calibration's "
        "ffn_extra_item_s instead of a whole item)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for role in ("attention", "ffn"):
        p.add_argument(
            f"--{role}-share",
            type=float,
            default=None,
            metavar="PERCENT",
            help=f"percent of one GPU's SMs each {role} rank holds under CUDA MPS (needs a "
            f"calibration measured under MPS shares; compute scales as calibrated share / "
            f"this, measured 1.8-2.2x faster at 50 %% than at 25 %%; default: the "
            f"calibration's)",
        )


def _calibrate_parser(kinds: Any) -> None:
    c = kinds.add_parser(
        "calibrate",
        help="fit a calibration file from afd run / afd bench prefill JSON or anchor figures",
        description=calibration_fit.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "runs",
        nargs="*",
        type=Path,
        help="afd run --json reports or afd bench prefill --json files (one preset, dtype "
        "and device)",
    )
    c.add_argument(
        "--anchors",
        type=Path,
        default=None,
        help="fit from a JSON file of measured per-layer figures with their sources instead",
    )
    _grid_options(c)
    c.add_argument("-o", "--output", type=Path, required=True, help="the calibration file")
    c.add_argument("--notes", default="", help="free text kept in the file")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(handler=run_calibrate)


def _sweep_parser(kinds: Any) -> None:
    s = kinds.add_parser(
        "sweep",
        help="A:F ratios x GPU counts: the best split per mode, async/sync and async/colocated",
        description=sweeping.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _model_options(s)
    s.add_argument(
        "--gpus",
        default="4,8,16,32,64",
        help="GPU counts (A + F for AFD, all of them for colocated DP+EP), comma-separated",
    )
    s.add_argument(
        "--ratios",
        default="1:3,1:2,1:1,2:1,3:1,5:1,7:1",
        help="A:F ratios to try, comma-separated, or 'all' for every split of each GPU count",
    )
    s.add_argument(
        "--modes", default="async,sync,colocated", help="modes to simulate, comma-separated"
    )
    s.add_argument(
        "--ffn-shares",
        default=None,
        metavar="PERCENTS",
        help="one GPU shared under CUDA MPS: --gpus counts the ranks on it, and each split is "
        "tried at each of these percents of the SMs per FFN rank (comma-separated), the "
        "attention ranks sharing the rest equally; needs an MPS calibration and --modes "
        "without colocated",
    )
    _workload_options(s)
    _deployment_options(s)
    s.add_argument("--json", type=Path, default=None, help="write every configuration here")
    s.add_argument("--plot", type=Path, default=None, help="write a PNG of the sweep here")
    s.add_argument(
        "--label",
        default="projection",
        help="what the figures are, printed above the table and in the plot's title",
    )
    s.set_defaults(handler=run_sweep)


# shared ---------------------------------------------------------------------------------
def _calibration(args: argparse.Namespace) -> Calibration:
    cal = costs.load(args.calibration)
    if args.cores is not None:
        if not args.cores > 0:
            raise SimError(f"--cores must be > 0, got {args.cores}")
        cal = cal.replace(cores=args.cores)
    if args.sync_barrier is not None:
        cal = cal.replace(host_barrier=args.sync_barrier == "host")
    return cal


def _config(args: argparse.Namespace, cal: Calibration) -> Any:
    name = args.preset or cal.preset
    if name not in PRESET_NAMES:
        raise SimError(f"the calibration's preset {name!r} is not one of {list(PRESET_NAMES)}")
    layers = args.layers if args.layers is not None else cal.layers
    config = preset(name, num_layers=layers)
    if not args.any_preset:
        if name != cal.preset:
            raise SimError(
                f"--preset {name}: calibration {args.calibration} was measured with {cal.preset} "
                f"shapes; use a calibration of {name}, or add --any-preset for a what-if"
            )
        if cal.layers is not None and config.num_hidden_layers != cal.layers:
            raise SimError(
                f"--layers {config.num_hidden_layers}: calibration {args.calibration} lumps "
                f"per-step work into its {cal.layers}-layer figures; add --any-preset for a "
                f"what-if"
            )
    return config


def _lengths(args: argparse.Namespace, config: Any) -> list[int]:
    try:
        if args.workload_file is not None:
            prompts = read_workload(
                args.workload_file, config.max_position_embeddings, config.vocab_size
            )
            return [n for n, _ in prompts]
        if args.max_prompt_len > config.max_position_embeddings:
            raise WorkloadError(
                f"--max-prompt-len {args.max_prompt_len} exceeds the model's longest prompt "
                f"({config.max_position_embeddings})"
            )
        return prompt_lengths(args.workload, args.requests, args.seed, args.max_prompt_len)
    except WorkloadError as exc:
        raise SimError(str(exc)) from None


def _arrivals(args: argparse.Namespace, count: int) -> list[float]:
    try:
        return arrival_times(count, args.rate, args.seed)
    except WorkloadError as exc:
        raise SimError(str(exc)) from None


def _wire(args: argparse.Namespace) -> Wire:
    return Wire(args.wire_format, args.combine_reduce, args.shared)


@contextmanager
def _bar(total: int, what: str, hidden: bool) -> Iterator[Any]:
    """A rich progress bar on a terminal (a callable that advances it), else a no-op."""
    if hidden or not sys.stderr.isatty():
        yield lambda *_: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda *_: bar.advance(task)


# afd sim ----------------------------------------------------------------------------------
def run_sim(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    cal = _calibration(args)
    config = _config(args, cal)
    for path in (args.json, args.plot):
        check_writable(path)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    colocated = args.colocated or ("dp" if cal.device == "cpu" else "dp-ep")
    dep = deployment(
        config,
        cal,
        attention_ranks=args.attention_ranks,
        ffn_ranks=args.ffn_ranks,
        budget=args.max_num_batched_tokens,
        stages=args.stages,
        min_stage_tokens=args.min_stage_tokens,
        colocated=colocated,
        ffn_batch=args.ffn_batch,
        wire=_wire(args),
        attention_share=args.attention_share,
        ffn_share=args.ffn_share,
    )
    lengths = _lengths(args, config)
    arrivals = _arrivals(args, len(lengths))
    try:
        requests = assign(lengths, arrivals, args.attention_ranks, args.assign)
    except WorkloadError as exc:
        raise SimError(str(exc)) from None
    print(
        f"afd sim (simulated, calibration {args.calibration}: {cal.device}, measured "
        f"{cal.date or 'date unknown'}): {args.attention_ranks} attention x {args.ffn_ranks} "
        f"FFN, preset {args.preset or cal.preset} "
        f"({config.num_hidden_layers} layers, {config.n_routed_experts} experts "
        f"top-{config.num_experts_per_tok}), {len(lengths)} requests "
        f"({args.workload_file or args.workload}: {sum(lengths)} tokens, sum of squares "
        f"{sum(n * n for n in lengths)}), modes {', '.join(modes)}; colocated = {colocated}"
        f"{'' if cal.cores is None else f'; {cal.cores:g} shared cores'}"
        f"{_shares_note(cal, args.attention_share, args.ffn_share)}"
    )
    results = simulate(dep, modes, requests, args.assign)
    summaries: dict[str, ModeSummary] = {m: s for m, (_, s) in results.items()}
    print_report(
        summaries, ratios(summaries), title=f"afd sim ({cal.device} calibration): prefill, per mode"
    )
    if args.json is not None:
        report = {
            "simulated": True,
            "calibration": cal.to_json(),
            "args": {k: str(v) for k, v in vars(args).items() if k != "handler"},
            "modes": {m: s.as_dict() for m, s in summaries.items()},
            "ratios": ratios(summaries),
            "requests": [r.__dict__ for r in requests],
            # per mode, each request's replica (in request order): the mode's assignment
            "served_by": {m: [r.replica for r in run.requests] for m, (run, _) in results.items()},
        }
        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
        print(f"wrote {args.json}")
    if args.plot is not None:
        outcomes = [
            ([mode], run.requests, [{mode: r} for r in run.replicas], run.ffn_intervals)
            for mode, (run, _) in results.items()
        ]
        write_atomically(args.plot, lambda tmp: write_timeline(tmp, summaries, outcomes))
        print(f"wrote {args.plot}")
    print(f"simulated in {time.perf_counter() - started:.2f} s")
    return 0


def _shares_note(cal: Calibration, attention: float | None, ffn: float | None) -> str:
    """``; SM shares attention 25 %, FFN 50 % (calibrated at 25 % / 25 %)`` or nothing."""
    if cal.attention_share is None or cal.ffn_share is None:
        return ""
    a = cal.attention_share if attention is None else attention
    f = cal.ffn_share if ffn is None else ffn
    return (
        f"; SM shares attention {a:.4g} %, FFN {f:.4g} % (calibrated at "
        f"{cal.attention_share:.4g} % / {cal.ffn_share:.4g} %; a colocated mode computes at "
        f"the calibrated shares)"
    )


# afd sim calibrate ------------------------------------------------------------------------
def _grid_options(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--cores-grid",
        default=",".join(str(v) for v in calibration_fit.CORES_GRID),
        help="runs: candidate values of the shared-processor count, comma-separated "
        "('none': one processor per rank, e.g. one GPU each)",
    )
    c.add_argument(
        "--notify-grid",
        default=",".join(f"{v * 1e6:g}" for v in calibration_fit.NOTIFY_GRID),
        help="runs: candidate arrival-notification latencies in microseconds, comma-separated",
    )
    c.add_argument(
        "--idle-grid",
        default=",".join(f"{v:g}" for v in calibration_fit.IDLE_GRID),
        help="runs: candidate shares of a core that a waiting (polling) rank takes, "
        "comma-separated",
    )


def _fit_grids(args: argparse.Namespace) -> dict[str, list[Any]]:
    return {
        "cores_grid": _grid(args.cores_grid, 1.0, "cores-grid", True),
        "notify_grid": _grid(args.notify_grid, 1e-6, "notify-grid", False),
        "idle_grid": _grid(args.idle_grid, 1.0, "idle-grid", False),
    }


def _validate_parser(kinds: Any) -> None:
    v = kinds.add_parser(
        "validate",
        help="leave one A:F pair (or workload) out: predict its runs from a fit on the others",
        description=validation.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument(
        "runs",
        nargs="+",
        type=Path,
        help="afd run --json reports of at least two A:F pairs (or workloads, with --hold-out "
        "workload); one preset, dtype and device",
    )
    _grid_options(v)
    v.add_argument(
        "--hold-out",
        choices=sorted(validation.HOLD_OUT),
        default="pair",
        help="what each fold leaves out: an A:F pair (default), or a workload (the prompt "
        "mix by name: can a fit on one mix predict another?)",
    )
    v.add_argument(
        "--predict",
        nargs="+",
        type=Path,
        default=None,
        metavar="RUNS",
        help="instead of leaving one out: fit once on the positional runs and predict these "
        "(e.g. full-size runs from a fit on quick ones); --hold-out does not apply",
    )
    v.add_argument(
        "--tolerance", type=float, default=0.15, help="relative error counted as a good prediction"
    )
    v.add_argument("--json", type=Path, default=None, help="write every prediction here")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.set_defaults(handler=run_validate)


def run_validate(args: argparse.Namespace) -> int:
    if args.json is not None:
        check_writable(args.json)
    if not 0 < args.tolerance < 10:
        raise SimError(f"--tolerance {args.tolerance}: give a fraction, e.g. 0.15")
    runs = read_runs(list(args.runs))
    fit = _fit_grids(args)
    if args.predict is not None:
        if args.hold_out != "pair":
            raise SimError("--predict fits once and predicts the runs it names: drop --hold-out")
        targets = read_runs(list(args.predict))
        both = [t.source for t in targets if any(t.same_measurement(r) for r in runs)]
        if both:
            raise SimError(
                f"--predict: {', '.join(both)} {'is' if len(both) == 1 else 'are'} also among "
                f"the runs fitted on, so the prediction would be in-sample; name each run once"
            )
        predictions = validation.predict_held_out(runs, targets, **fit)
    else:
        groups = validation.folds(runs, args.hold_out)
        with _bar(len(groups), "folds", args.no_progress) as advance:
            predictions = validation.leave_one_out(runs, args.hold_out, progress=advance, **fit)
    print(validation.table(predictions))
    for line in validation.gaps(predictions, one_fit=args.predict is not None):
        print(line)
    print(validation.verdict(predictions, args.tolerance))
    if args.json is not None:
        rows = [dataclasses.asdict(p) for p in predictions]
        text = json.dumps({"command": shlex.join(sys.argv), "predictions": rows}, indent=1)
        write_atomically(args.json, lambda tmp: tmp.write_text(text + "\n"))
        print(f"wrote {args.json}")
    return 0


def _bundle_parser(kinds: Any) -> None:
    b = kinds.add_parser(
        "bundle",
        help="keep a measurement campaign in one file that calibrate and validate read",
        description=measured.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument(
        "runs", nargs="+", type=Path, help="afd run --json reports (or bench files, bundles)"
    )
    b.add_argument(
        "-o", "--output", type=Path, required=True, help="the bundle (name it *.json.gz)"
    )
    b.add_argument("--notes", default="", help="free text kept in the bundle (machine, date)")
    b.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default=None,
        help="keep only the runs of this preset (a calibration holds one; afd bench prefill "
        "writes every preset it ran into one file)",
    )
    b.add_argument(
        "--exclude",
        nargs="+",
        type=Path,
        default=None,
        metavar="RUNS",
        help="leave out every report that is the same measurement (deployment, requests and "
        "measured modes) as one in these files: the new runs of a bench file that also "
        "holds runs bundled before",
    )
    b.set_defaults(handler=run_bundle)


def run_bundle(args: argparse.Namespace) -> int:
    if not args.output.name.endswith(".json.gz"):
        raise SimError(f"-o {args.output}: a run bundle is gzip-compressed JSON; name it *.json.gz")
    check_writable(args.output)
    argv = ["afd", "sim", "bundle", *(str(p) for p in args.runs), "-o", str(args.output)]
    if args.notes:
        argv += ["--notes", args.notes]
    if args.preset:
        argv += ["--preset", args.preset]
    if args.exclude:
        argv += ["--exclude", *(str(p) for p in args.exclude)]
    data = measured.bundle(list(args.runs), shlex.join(argv), args.notes, args.preset, args.exclude)
    payload = measured.encode_bundle(data)
    write_atomically(args.output, lambda tmp: tmp.write_bytes(payload))
    print(f"wrote {args.output}: {len(data['reports'])} reports, {len(payload) / 1e3:.1f} kB")
    return 0


def _grid(text: str, scale: float, name: str, allow_none: bool) -> list[Any]:
    out: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if allow_none and part.lower() == "none":
            out.append(None)
            continue
        try:
            value = float(part) * scale
        except ValueError:
            raise SimError(f"--{name}: {part!r} is not a number") from None
        if not value > 0 and not (name != "cores-grid" and value == 0):
            raise SimError(f"--{name}: {part!r} must be > 0")
        out.append(value)
    if not out:
        raise SimError(f"--{name} is empty")
    return out


def run_calibrate(args: argparse.Namespace) -> int:
    check_writable(args.output)
    command = _command(args)
    date = datetime.date.today().isoformat()
    if args.anchors is not None:
        if args.runs:
            raise SimError("give measured runs or --anchors, not both")
        try:
            anchors = json.loads(args.anchors.read_text())
        except OSError as exc:
            raise SimError(f"cannot read {args.anchors}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise SimError(f"{args.anchors}: not valid JSON ({exc.msg})") from None
        if not isinstance(anchors, dict):
            raise SimError(f"{args.anchors}: anchors are one JSON object")
        cal = calibration_fit.fit_anchors(anchors, command, date)
    else:
        if not args.runs:
            raise SimError("give afd run --json reports to calibrate from (or --anchors FILE)")
        runs = read_runs(list(args.runs))
        fit = _fit_grids(args)
        points = len(fit["cores_grid"]) * len(fit["notify_grid"]) * len(fit["idle_grid"])
        with _bar(points, "grid", args.no_progress) as advance:
            cal = calibration_fit.fit_runs(runs, progress=advance, **fit)
        cal = cal.replace(command=command, date=date)
    if args.notes:
        cal = cal.replace(notes=args.notes)
    text = json.dumps(cal.to_json(), indent=2) + "\n"
    write_atomically(args.output, lambda tmp: tmp.write_text(text))
    print(_describe(cal))
    print(f"wrote {args.output}")
    return 0


def _command(args: argparse.Namespace) -> str:
    """The calibrate command that reproduces this calibration (kept in the file)."""
    argv = ["afd", "sim", "calibrate", *(str(p) for p in args.runs)]
    if args.anchors is not None:
        argv += ["--anchors", str(args.anchors)]
    else:
        argv += ["--cores-grid", args.cores_grid, "--notify-grid", args.notify_grid]
        argv += ["--idle-grid", args.idle_grid]
    argv += ["-o", str(args.output)]
    if args.notes:
        argv += ["--notes", args.notes]
    return shlex.join(argv)


def _describe(cal: Calibration) -> str:
    lines = [
        f"calibration: {cal.device}, preset {cal.preset}, {cal.dtype}"
        + (f", {cal.layers} layers" if cal.layers else ""),
        f"  attention per layer: {cal.attn_fixed_s * 1e3:.4g} ms + {cal.attn_token_s * 1e6:.4g} "
        f"us/token + {cal.attn_square_s * 1e9:.4g} ns/token^2",
        f"  FFN per item: {cal.ffn_item_s * 1e3:.4g} ms + {cal.ffn_expert_s * 1e6:.4g} "
        f"us/expert + {cal.ffn_row_s * 1e9:.4g} ns/row",
        f"  dispatch: {cal.dispatch_latency_s * 1e6:.4g} us + bytes / "
        f"{cal.dispatch_bandwidth / 1e9:.4g} GB/s; combine: {cal.combine_latency_s * 1e6:.4g} "
        f"us + bytes / {cal.combine_bandwidth / 1e9:.4g} GB/s; notify {cal.notify_s * 1e6:.4g} us",
        f"  colocated collective: {cal.collective_latency_s * 1e6:.4g} us + bytes / "
        f"{cal.collective_bandwidth / 1e9:.4g} GB/s; cores: "
        f"{'one per rank' if cal.cores is None else format(cal.cores, 'g')}",
        "  sync barrier: "
        + ("on the host (reached at launch)" if cal.host_barrier else "after the attention")
        + (
            ""
            if cal.attention_share is None or cal.ffn_share is None
            else f"; SM shares per rank: attention {cal.attention_share:g} %, FFN "
            f"{cal.ffn_share:g} % (compute at other shares scales as these / the share)"
        ),
    ]
    if cal.fit:
        lines.append(
            f"  fit: {cal.fit.get('runs')} runs, mean |log error| of makespan and TTFT p50 "
            f"{cal.fit.get('mean_abs_log_error_makespan_ttft_p50', float('nan')):.3f}"
        )
        for name, why in cal.fit.get("not_determined", {}).items():
            lines.append(f"  not determined, set to 0: {name}: {why}")
    return "\n".join(lines)


# afd sim sweep ----------------------------------------------------------------------------
def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SimError(
            f"--{name}: {text!r} is not a comma-separated list of whole numbers"
        ) from None
    if not values:
        raise SimError(f"--{name} is empty")
    return values


def run_sweep(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    cal = _calibration(args)
    config = _config(args, cal)
    for path in (args.json, args.plot):
        check_writable(path)
    gpus = _ints(args.gpus, "gpus")
    ratio_list = None if args.ratios == "all" else sweeping.parse_ratios(args.ratios)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SimError(f"--modes: {bad or modes} not among {list(MODES)}")
    ffn_shares = None
    if args.ffn_shares is not None:
        if args.attention_share is not None or args.ffn_share is not None:
            raise SimError(
                "--ffn-shares chooses every rank's share; leave out --attention-share and "
                "--ffn-share"
            )
        ffn_shares = sweeping.parse_shares(args.ffn_shares)
    lengths = _lengths(args, config)
    arrivals = _arrivals(args, len(lengths))
    total = sweeping.count_jobs(gpus, ratio_list, modes, ffn_shares)
    print(
        f"afd sim sweep ({args.label}; calibration {args.calibration}: {cal.device}): preset "
        f"{args.preset or cal.preset} ({config.num_hidden_layers} layers), {len(lengths)} "
        f"requests ({args.workload_file or args.workload}, longest {max(lengths)}), budget "
        f"{args.max_num_batched_tokens}, stages {args.stages}; {total} configurations"
        + (
            f"; the ranks share one GPU, FFN shares {args.ffn_shares} %"
            if ffn_shares is not None
            else _shares_note(cal, args.attention_share, args.ffn_share)
        )
    )
    with _bar(total, "configurations", args.no_progress) as advance:
        points = sweeping.sweep(
            config,
            cal,
            lengths,
            arrivals,
            gpus=gpus,
            ratios=ratio_list,
            budget=args.max_num_batched_tokens,
            stages=args.stages,
            min_stage_tokens=args.min_stage_tokens,
            wire=_wire(args),
            modes=modes,
            policy=args.assign,
            ffn_batch=args.ffn_batch,
            progress=advance,
            ffn_shares=ffn_shares,
            attention_share=args.attention_share,
            ffn_share=args.ffn_share,
        )
    rows = sweeping.best(points)
    print(sweeping.markdown(rows, "ranks on one GPU" if ffn_shares is not None else "GPUs"))
    elapsed = time.perf_counter() - started
    if args.json is not None:
        report = {
            "label": args.label,
            "calibration": cal.to_json(),
            "args": {k: str(v) for k, v in vars(args).items() if k != "handler"},
            "best": rows,
            "points": [p.__dict__ for p in points],
            "elapsed_s": elapsed,
        }
        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
        print(f"wrote {args.json}")
    if args.plot is not None:
        title = (
            f"afd sim sweep ({args.label}): {args.preset or cal.preset}, "
            f"{config.num_hidden_layers} layers, {len(lengths)} requests "
            f"({args.workload_file or args.workload}), calibration {args.calibration}"
        )
        one_gpu = ffn_shares is not None
        write_atomically(
            args.plot, lambda tmp: sweeping.write_plot(tmp, points, title, one_gpu=one_gpu)
        )
        print(f"wrote {args.plot}")
    print(f"{len(points)} configurations x {len(lengths)} requests in {elapsed:.1f} s")
    return 0
