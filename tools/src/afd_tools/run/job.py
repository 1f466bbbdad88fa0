"""What ``afd run`` runs, as one frozen, validated object: :class:`RunJob`.

A job is the deployment (A attention replicas, F FFN ranks, model shapes, batching budget,
dtype, wire format, who reduces, where shared experts run, stages, device, transport,
expert backend, how ranks share GPUs), the workload, the modes to compare, the
verification's tie margin, the seeds and timeouts, and the output options. ``afd run``
builds one from its command line (:func:`afd_tools.run.command.job_from_args`, the one
place that reads the parsed options); ``afd bench prefill`` and ``afd soak`` build theirs
directly, and :func:`afd_tools.run.api.run_job` runs any of them.

Fields left ``None`` (``dtype``, ``backend``, ``transport``, ``colocated``) follow from the
device when the job is planned (:func:`afd_tools.run.plan.prepare`); what a job may be is
checked at construction, with an error naming the option to change. Checks that need the
machine (is there a GPU, is the transport installed, do the ranks fit the GPUs) wait for
the plan.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd_models import PRESET_NAMES
from afd_protocol import CombineReduce, SharedPlacement, WireFormat
from afd_tools.prefill.run_report import Deployment
from afd_tools.prefill.workload import ASSIGNMENTS, PRESETS, WorkloadError
from afd_tools.run.devices import COLOCATED
from afd_tools.run.verify import QUANT_TIE_MARGIN, TIE_MARGIN, TIE_MARGIN_FROM, TIE_MARGIN_SOURCES

MODES = ("async", "sync", "colocated")
"""The modes ``afd run`` compares, in the order they run."""
DEVICES = ("auto", "cpu", "cuda")
WARM_PASS = ("auto", "on", "off")
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
"""Relative error a request's output may have against the monolithic reference, by dtype."""
EXCHANGE_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
"""Relative error what one MoE exchange returns for a row may have against the reference's
experts on the same row, by dtype (int8 dispatch: :data:`QUANT_TOLERANCE`): one layer's
rounding, so in bf16 half the end-to-end tolerance. On the 2-core CPU machine the worst of
14,040 bf16 rows (27 layers, 32 requests, up to 8 tokens a chunk) was 5.1e-3, of 1,620 at 4
layers 4.6e-3 (tiny) and 4.5e-3 (v3-mini); on one H100 3.4e-4 (v2-lite, 27 layers, last
tokens only); float32 0 on CPU. A 1.5 % scale on the FFN side passed the 2e-2 tolerance."""
QUANT_TOLERANCE = 5e-2
"""Relative error allowed when dispatch rows travel as int8 (about amax / 254 per element,
compounded over the layers)."""


def option(name: str) -> str:
    """The ``afd run`` option of the job field ``name`` (``max_num_batched_tokens`` ->
    ``--max-num-batched-tokens``)."""
    return "--" + name.replace("_", "-")


def _choose(name: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        raise WorkloadError(f"{option(name)} {value}: choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class RunJob:
    """Everything one ``afd run`` needs; the defaults are ``afd run``'s.

    The field names are the option names of ``afd run`` (``--attention-ranks`` is
    :attr:`attention_ranks`), except :attr:`modes`, which ``--mode`` gives one or all of.
    """

    # where the ranks run and how they share GPUs
    device: str = "auto"
    """``auto`` (cuda when a GPU is visible), ``cpu`` or ``cuda``."""
    share_gpus: bool = False
    mps_attention_share: int | None = None
    """Percent of its GPU's SMs each attention rank may use, where ranks share GPUs."""
    mps_ffn_share: int | None = None
    no_mps: bool = False
    # the model and the AFD deployment
    preset: str = "tiny"
    layers: int | None = None
    """Overrides the preset's layer count (``None``: the preset's own)."""
    attention_ranks: int = 2
    ffn_ranks: int = 2
    modes: tuple[str, ...] = MODES
    # the workload
    workload: str = "uneven"
    workload_file: Path | None = None
    """JSONL prompts (overrides :attr:`workload`, :attr:`requests`, :attr:`max_prompt_len`)."""
    requests: int = 48
    max_prompt_len: int = 256
    rate: float | None = None
    """Poisson arrivals per second (``None``: all at once)."""
    assign: str = "round-robin"
    max_num_batched_tokens: int = 256
    """Tokens per prefill step and replica: the batching budget and the slot capacity."""
    dtype: str | None = None
    tie_margin: float | None = None
    """Verification: the router-score gap of a near tie (``None``: the dtype's default)."""
    tie_margin_from: str = TIE_MARGIN_FROM
    """Verification: what judges a decision the reference followed at a near tie:
    ``depth`` (the margin grown with the layer) or ``drift`` (the tighter margin from the
    drift measured at the probed tokens; :class:`afd_tools.run.verify.DriftMargins`)."""
    colocated: str | None = None
    # the wire
    stages: int = 1
    min_stage_tokens: int = 0
    """Async mode: a step is cut into fewer stages where it has under this many tokens per
    stage (``afd_models.stage_count``); 0: always ``stages``."""
    shared: str = SharedPlacement.ATTENTION.value
    wire_format: str = WireFormat.PER_RANK.value
    combine_reduce: str = CombineReduce.FFN.value
    transport: str | None = None
    cam_dynamic_quant: bool = False
    backend: str | None = None
    ffn_graph_buckets: tuple[int, ...] | None = None
    """FFN ranks: the routed experts as CUDA-graph replays, one graph per bucket of rows
    (``afd_models.GraphedExperts``; needs the ``triton`` backend)."""
    exchange_graphs: int = 0
    """Attention ranks: each MoE layer's dispatch and combine as CUDA-graph replays, up to
    this many token counts held (transports that have them: ``nvshmem``); 0: eager."""
    peer_puts: bool = False
    """Every slot sent with NVSHMEM device puts from local staging instead of stores into
    peers' mapped windows (transports that have it: ``nvshmem``; not with ``ffn_graph``)."""
    ffn_graph: bool = False
    """FFN ranks: the whole serve loop (take an item, the experts, the reply) replayed from
    one CUDA graph (``afd_transport_nvshmem.graphed_ffn``; ``triton`` backend, ``nvshmem``)."""
    warm_pass: str = "auto"
    """Prefill every request once, untimed, before the timed modes: ``on``, ``off`` or
    ``auto`` (on for cuda ranks; :meth:`warms_whole_workload`)."""
    # seeds and limits
    seed: int = 0
    """Seeds the weights and the workload."""
    timeout: float = 120.0
    """Seconds an attention rank waits for FFN replies."""
    run_timeout: float = 1800.0
    """Seconds the whole run may take."""
    # outputs (written by the command, checked before anything runs)
    json: Path | None = None
    plot: Path | None = None
    no_progress: bool = False

    def __post_init__(self) -> None:
        _choose("device", self.device, DEVICES)
        _choose("preset", self.preset, PRESET_NAMES)
        if not self.modes or any(m not in MODES for m in self.modes):
            raise WorkloadError(f"--mode {','.join(self.modes)}: choose from {', '.join(MODES)}")
        if len(set(self.modes)) != len(self.modes):
            raise WorkloadError(f"--mode {','.join(self.modes)}: each mode once")
        _choose("workload", self.workload, PRESETS)
        _choose("assign", self.assign, ASSIGNMENTS)
        if self.dtype is not None:
            _choose("dtype", self.dtype, sorted(TOLERANCE))
        if self.colocated is not None:
            _choose("colocated", self.colocated, COLOCATED)
        _choose("shared", self.shared, [s.value for s in SharedPlacement])
        _choose("wire_format", self.wire_format, [w.value for w in WireFormat])
        _choose("combine_reduce", self.combine_reduce, [c.value for c in CombineReduce])
        _choose("warm_pass", self.warm_pass, WARM_PASS)
        if self.stages < 1:
            raise WorkloadError(f"--stages must be >= 1, got {self.stages}")
        if self.min_stage_tokens < 0:
            raise WorkloadError(
                f"--min-stage-tokens must be >= 0 (0: always --stages), got {self.min_stage_tokens}"
            )
        if self.attention_ranks < 1 or self.ffn_ranks < 1:
            raise WorkloadError("--attention-ranks and --ffn-ranks must be >= 1")
        if self.layers is not None and self.layers < 1:
            raise WorkloadError(f"--layers must be >= 1, got {self.layers}")
        if self.max_num_batched_tokens < 1:
            raise WorkloadError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.ffn_graph_buckets is not None and (
            not self.ffn_graph_buckets or min(self.ffn_graph_buckets) < 1
        ):
            raise WorkloadError(
                f"--ffn-graph-buckets {self.ffn_graph_buckets}: row counts >= 1, e.g. 1024,8192"
            )
        if self.ffn_graph and self.ffn_graph_buckets is not None:
            raise WorkloadError(
                "--ffn-graph already replays the experts inside the serve loop's graph; drop "
                "--ffn-graph-buckets"
            )
        if self.peer_puts and self.ffn_graph:
            raise WorkloadError(
                "--ffn-graph stores replies straight into the attention ranks' windows, which "
                "--peer-puts does not map; drop one of them"
            )
        if self.exchange_graphs < 0:
            raise WorkloadError(
                f"--exchange-graphs is how many token counts to hold as CUDA graphs (0: "
                f"none), got {self.exchange_graphs}"
            )
        if self.tie_margin is not None and not 0 <= self.tie_margin <= 1:
            raise WorkloadError(f"--tie-margin must be within [0, 1], got {self.tie_margin}")
        if self.tie_margin_from not in TIE_MARGIN_SOURCES:
            raise WorkloadError(
                f"--tie-margin-from must be one of {', '.join(TIE_MARGIN_SOURCES)}, got "
                f"{self.tie_margin_from!r}"
            )
        for name in ("timeout", "run_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise WorkloadError(f"{option(name)} must be > 0 seconds, got {value}")
        if self.combine_reduce == CombineReduce.FFN.value and self.wire_format != "per_rank":
            raise WorkloadError(
                "--combine-reduce ffn needs --wire-format per_rank (per_choice rows carry no "
                "weights for the FFN ranks to reduce with); add --combine-reduce attention"
            )

    @property
    def mode_option(self) -> str:
        """:attr:`modes` as ``--mode`` says it: ``all``, one mode, or several joined by
        commas (which only a job built in code has)."""
        return "all" if self.modes == MODES else ",".join(self.modes)

    def as_args(self) -> dict[str, str]:
        """Every option as a string, by option name, as the report's ``args`` keeps them
        for a person reading it."""
        out = {"command": "run"}
        for f in dataclasses.fields(self):
            name, value = f.name, getattr(self, f.name)
            if name == "modes":
                name, value = "mode", self.mode_option
            out[name] = str(value)
        return out

    def command_line(self) -> str:
        """The ``afd run`` command that runs this job (the options that differ from the
        defaults), for a person to read or rerun."""
        default = RunJob()
        words = ["afd", "run"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == getattr(default, f.name):
                continue
            if f.name == "modes":
                words += ["--mode", self.mode_option]
            elif isinstance(value, bool):
                words.append(option(f.name))
            elif isinstance(value, tuple):
                words += [option(f.name), ",".join(str(v) for v in value)]
            else:
                words += [option(f.name), str(value)]
        return " ".join(shlex.quote(w) for w in words)

    @property
    def tolerance(self) -> float:
        """The relative error a request's output may have (the dtype's, or int8's with
        :attr:`cam_dynamic_quant`); the dtype must be resolved."""
        return QUANT_TOLERANCE if self.cam_dynamic_quant else TOLERANCE[self.resolved("dtype")]

    @property
    def exchange_tolerance(self) -> float:
        """What one MoE exchange may return off the reference's experts
        (:data:`EXCHANGE_TOLERANCE`, or int8's end-to-end tolerance with
        :attr:`cam_dynamic_quant`: its rows carry the quantisation); the dtype must be
        resolved."""
        if self.cam_dynamic_quant:
            return QUANT_TOLERANCE
        return EXCHANGE_TOLERANCE[self.resolved("dtype")]

    @property
    def margin(self) -> float:
        """The router-score gap under which verification follows the run's experts."""
        if self.tie_margin is not None:
            return float(self.tie_margin)
        if self.cam_dynamic_quant:
            return QUANT_TIE_MARGIN
        return TIE_MARGIN[self.resolved("dtype")]

    def deployment(self, device: str) -> Deployment:
        """The report's record of this (resolved) job on ``device`` (``cpu`` or ``cuda``):
        each :class:`~afd_tools.prefill.run_report.Deployment` field is this job's field of
        the same name, but ``warm_pass`` and ``baseline_warm_pass``, which record whether
        the pass ran on ``device``."""
        values = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(Deployment)
            if f.name not in ("device", "baseline_warm_pass")
        }
        for name in ("dtype", "backend", "transport", "colocated"):
            values[name] = self.resolved(name)
        values["warm_pass"] = self.warms_whole_workload(device)
        values["baseline_warm_pass"] = values["warm_pass"]  # every colocated launch runs it
        if self.workload_file is not None:
            values["workload_file"] = str(self.workload_file)
        if self.rate is not None:
            values["rate"] = float(self.rate)
        return Deployment(device=device, **values)

    def warms_whole_workload(self, device: str) -> bool:
        """Whether ranks on ``device`` (``cpu``, ``cuda``, ``cuda:N``) run the warm-up pass."""
        if self.warm_pass == "auto":
            return device.startswith("cuda")
        return self.warm_pass == "on"

    def resolved(self, name: str) -> str:
        """The value of ``name`` (``dtype``, ``backend``, ``transport``, ``colocated``) once
        the plan has filled it in."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"RunJob.{name} is not resolved yet (it follows from the device when the job "
                "is planned: afd_tools.run.plan.prepare)"
            )
        return str(value)
