"""A :class:`~afd_tools.run.job.RunJob` made concrete for this machine, before anything
runs: :func:`prepare` resolves the device and its defaults, places the ranks, checks the
transport and the output paths, builds the AFD window and connection factory, and draws the
workload. Every configuration error surfaces here, as one :class:`WorkloadError` (or
:class:`~afd_protocol.AFDError`) naming the option to change, before a process starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from afd_models import DeepseekConfig, preset
from afd_protocol import (
    AFDError,
    CombineReduce,
    DeviceSharing,
    SharedPlacement,
    SlotLayout,
    Topology,
    TransportFactory,
    TransportOptions,
    TransportSpec,
    WindowLayout,
    WireFormat,
    available_transports,
    get_transport,
)
from afd_tools.outputs import check_writable
from afd_tools.prefill.workload import (
    Request,
    WorkloadError,
    arrival_times,
    assign,
    prompt_lengths,
    read_workload,
)
from afd_tools.run.capacity import check_experts_fit
from afd_tools.run.devices import DEVICE_DEFAULTS, Placement, place, resolve_device
from afd_tools.run.job import RunJob
from afd_tools.run.sharing import afd_shares, check_mps_options, describe_sharing


@dataclass(frozen=True)
class RunPlan:
    """A job ready to launch: resolved, placed and checked, with its workload drawn."""

    job: RunJob
    """The job with the device defaults filled in (``dtype``, ``backend``, ``transport``)
    and ``colocated`` as placed."""
    config: DeepseekConfig
    placement: Placement
    shares: dict[str, int]
    """Each AFD rank's CUDA MPS share by rank name (empty: no GPU shared under MPS)."""
    lengths: list[int]
    arrivals: list[float]
    tokens: list[tuple[int, ...] | None] | None
    """The workload file's token ids per prompt (``None``: drawn from the seed)."""
    requests: list[Request]
    """The requests assigned over the AFD attention replicas."""
    afd_transport: tuple[WindowLayout, TransportFactory] | None
    """The AFD launch's window and connection factory (``None`` when only a colocated
    baseline of its own launch runs)."""

    @property
    def modes(self) -> tuple[str, ...]:
        return self.job.modes

    @property
    def separate_colocated(self) -> bool:
        """Whether the colocated baseline is a launch of its own (dp-ep, mono); colocated
        dp runs inside the AFD launch."""
        return "colocated" in self.modes and self.job.colocated != "dp"

    @property
    def afd_modes(self) -> list[str]:
        """The modes the AFD launch runs."""
        return [m for m in self.modes if not (m == "colocated" and self.separate_colocated)]

    @property
    def total(self) -> int:
        """Request prefills over every mode (what the progress counts)."""
        return len(self.requests) * len(self.modes)

    def describe(self) -> str:
        """The line ``afd run`` prints before it launches anything."""
        job, config, placement = self.job, self.config, self.placement
        square = sum(n * n for n in self.lengths)
        sharing = describe_sharing(placement, self.shares)
        return (
            f"afd run: {job.attention_ranks} attention x {job.ffn_ranks} FFN processes on "
            f"{placement.kind}{f' ({sharing})' if sharing else ''}, preset "
            f"{job.preset} ({config.num_hidden_layers} layers, {config.n_routed_experts} "
            f"experts top-{config.num_experts_per_tok}, {job.dtype}, {job.transport}), "
            f"{len(self.requests)} requests ({job.workload_file or job.workload}: "
            f"{sum(self.lengths)} tokens, sum of squares {square}), modes {', '.join(self.modes)}"
            + (f"; colocated: {placement.colocated_label}" if "colocated" in self.modes else "")
        )


def prepare(job: RunJob) -> RunPlan:
    """The plan of ``job`` on this machine, or the first configuration error."""
    overrides = {} if job.layers is None else {"num_layers": job.layers}
    config = preset(job.preset, **overrides)
    job, placement = _resolve(job)
    check_experts_fit(config, job.resolved("dtype"), placement, job.modes)
    shares = {} if job.no_mps else afd_shares(placement, job.mps_attention_share, job.mps_ffn_share)
    transport = get_transport(job.resolved("transport"))
    _check_transport_options(job, transport)
    for path in (job.json, job.plot):
        check_writable(path)
    longest = config.max_position_embeddings
    tokens: list[tuple[int, ...] | None] | None = None
    if job.workload_file is not None:
        prompts = read_workload(job.workload_file, longest, config.vocab_size)
        lengths = [length for length, _ in prompts]
        tokens = [given for _, given in prompts]
    else:
        if job.max_prompt_len > longest:
            raise WorkloadError(
                f"--max-prompt-len {job.max_prompt_len} exceeds the model's longest prompt "
                f"({longest}, max_position_embeddings)"
            )
        lengths = prompt_lengths(job.workload, job.requests, job.seed, job.max_prompt_len)
    arrivals = arrival_times(len(lengths), job.rate, job.seed)
    requests = assign(lengths, arrivals, job.attention_ranks, job.assign, tokens)
    plan = RunPlan(job, config, placement, shares, lengths, arrivals, tokens, requests, None)
    if plan.afd_modes:
        plan = dataclasses.replace(plan, afd_transport=_afd_transport(job, config, transport))
    return plan


def _resolve(job: RunJob) -> tuple[RunJob, Placement]:
    """``job`` with the device-dependent defaults filled in (``colocated`` as placed), and
    the ranks placed; the MPS options are checked against the placement."""
    kind = resolve_device(job.device)
    defaults = DEVICE_DEFAULTS[kind]
    dtype = job.dtype or defaults["dtype"]
    # torch's grouped GEMM needs bfloat16: the reference backend for any other dtype
    backend = job.backend or (defaults["backend"] if dtype == "bfloat16" else "reference")
    job = dataclasses.replace(
        job, dtype=dtype, backend=backend, transport=job.transport or defaults["transport"]
    )
    if job.ffn_graph and backend != "triton":
        raise WorkloadError(
            f"--ffn-graph replays the triton backend's kernels, but the FFN ranks' backend is "
            f"{backend}: add --backend triton"
        )
    if job.ffn_graph and job.shared != SharedPlacement.ATTENTION.value:
        raise WorkloadError(
            "--ffn-graph serves routed experts only: use --shared attention (the default)"
        )
    if job.ffn_graph_buckets is not None and backend != "triton":
        raise WorkloadError(
            f"--ffn-graph-buckets replays the triton backend's kernels, but the FFN ranks' "
            f"backend is {backend}: add --backend triton"
        )
    transport = get_transport(job.resolved("transport"))
    transport.check_device(kind, transport_option="--transport", device_option="--device")
    placement = place(kind, job.attention_ranks, job.ffn_ranks, job.share_gpus, job.colocated)
    job = dataclasses.replace(job, colocated=placement.colocated_mode)
    if placement.shared and transport.device_sharing is DeviceSharing.EXCLUSIVE:
        raise WorkloadError(
            f"--share-gpus: --transport {transport.name} runs one rank per GPU; drop --share-gpus"
        )
    check_mps_options(
        placement, job.mps_attention_share, job.mps_ffn_share, job.no_mps, transport.name
    )
    return job, placement


def _check_transport_options(job: RunJob, transport: TransportSpec) -> None:
    """Refuse the options ``--transport`` cannot honour, naming the ones that can."""
    if job.cam_dynamic_quant and not transport.dynamic_quant:
        able = [t.name for t in available_transports().values() if t.dynamic_quant]
        raise WorkloadError(
            f"--cam-dynamic-quant applies to --transport {' or '.join(able) or '(none here)'} only"
        )
    if job.ffn_graph and not transport.exchange_graphs:
        able = [t.name for t in available_transports().values() if t.exchange_graphs]
        raise WorkloadError(
            f"--ffn-graph applies to --transport {' or '.join(able) or '(none here)'} only (the "
            f"serve loop's kernels); drop it for --transport {transport.name}"
        )
    if job.exchange_graphs and not transport.exchange_graphs:
        able = [t.name for t in available_transports().values() if t.exchange_graphs]
        raise WorkloadError(
            f"--exchange-graphs applies to --transport {' or '.join(able) or '(none here)'} "
            f"only; drop it for --transport {transport.name}"
        )
    if job.peer_puts and not transport.peer_puts:
        able = [t.name for t in available_transports().values() if t.peer_puts]
        raise WorkloadError(
            f"--peer-puts applies to --transport {' or '.join(able) or '(none here)'} only; "
            f"drop it for --transport {transport.name}"
        )
    transport.check_shared_placement(
        job.shared, transport_option="--transport", shared_option="--shared"
    )


def _afd_transport(
    job: RunJob, config: DeepseekConfig, transport: TransportSpec
) -> tuple[WindowLayout, TransportFactory]:
    """The AFD launch's window and connection factory from the transport registry
    (checked before any process starts: why the deployment cannot run on it names it)."""
    topology = Topology(job.attention_ranks, job.ffn_ranks, config.n_routed_experts)
    slot = SlotLayout(
        topology,
        config.hidden_size,
        job.max_num_batched_tokens,
        config.num_experts_per_tok,
        dtype=job.resolved("dtype"),
        shared_placement=SharedPlacement(job.shared),
        wire_format=WireFormat(job.wire_format),
        combine_reduce=CombineReduce(job.combine_reduce),
    )
    options = TransportOptions(
        wait_timeout=job.timeout,
        dynamic_quant=job.cam_dynamic_quant,
        exchange_graphs=job.exchange_graphs,
        peer_puts=job.peer_puts,
    )
    try:
        factory = transport.factory(slot, options)
    except AFDError as exc:
        raise WorkloadError(f"--transport {transport.name}: {exc}") from None
    return slot.window(ring_depth=job.stages), factory
