"""The cost model of ``afd sim`` and its calibration file (versioned JSON).

Every cost is a small formula whose coefficients come from measurements
(:mod:`afd_tools.sim.calibrate`), so that a projection can always be traced back to a
measured number:

* attention, per layer and batch (or stage): ``attn_fixed_s + attn_token_s * T +
  attn_square_s * S``, where ``T`` is the batch's token count and ``S`` the sum over its
  prompt pieces of ``end**2 - begin**2`` (a whole prompt of ``n`` tokens adds ``n**2``:
  causal attention's work); on CPU the coefficients also carry the router, the local
  shared experts, the dense layers and the per-step overhead, measured together;
* a dense layer's MLP adds ``dense_token_s * T``; shared experts add ``shared_token_s``
  per token wherever they are placed;
* an FFN rank serving ``b`` work items at once: ``ffn_item_s + (b - 1) *
  ffn_extra_item_s + ffn_expert_s * E_touched + ffn_row_s * rows``, where ``E_touched`` is
  the expected number of its local experts that got a row (weight reads) and ``rows`` the
  routed rows it computes (tokens per expert times experts);
* dispatch and combine, on the attention rank: ``latency + bytes / bandwidth`` for the
  wire format's bytes (inter-node bytes at ``internode_bandwidth``); the arrival is seen
  ``notify_s`` later on the other side;
* colocated DP+EP's all_gather + reduce_scatter: ``collective_latency_s + (G - 1) *
  bytes_per_peer / collective_bandwidth`` each;
* ``attention_share`` / ``ffn_share`` (one GPU shared under CUDA MPS): the compute terms
  above are for a rank holding the calibration's percent of the SMs; a rank holding
  ``share`` percent takes ``calibrated / share`` times as long (:func:`share_scale`).
  Dispatch and combine are not scaled;
* ``cores``: when more ranks compute at once than there are cores, every one of them
  slows down to ``cores / busy`` (processor sharing), where a waiting rank counts as
  ``idle_load`` of a busy one (it polls); ``None`` means every rank has its own processor
  (a GPU each).

Routing is assumed uniform: every FFN rank gets ``T * k / F`` routed rows per item (see
``docs/sim.md`` for every assumption).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from afd_models import DeepseekConfig
from afd_protocol import AFDError

SCHEMA_VERSION = 1
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
META_BYTES_PER_ROW = 16
"""Per dispatched row: expert ids and weights beside the hidden state (an estimate)."""


class SimError(AFDError):
    """Bad input to ``afd sim`` (a calibration file, an option); the message says what to
    change."""


@dataclass(frozen=True)
class Calibration:
    """The coefficients of the cost model (module docstring), in seconds and bytes/s,
    with where they came from."""

    device: str
    """``cpu`` or a GPU's name; informational."""
    preset: str
    """The model shapes the coefficients were measured with (attention and FFN costs
    depend on the shapes; the simulator refuses another preset unless told)."""
    dtype: str
    attn_fixed_s: float
    attn_token_s: float
    attn_square_s: float
    ffn_item_s: float
    ffn_expert_s: float
    ffn_row_s: float
    dispatch_latency_s: float
    dispatch_bandwidth: float
    combine_latency_s: float
    combine_bandwidth: float
    notify_s: float
    barrier_s: float
    collective_latency_s: float
    collective_bandwidth: float
    ffn_extra_item_s: float | None = None
    """Per extra item served in one batch (None: same as ``ffn_item_s``)."""
    dense_token_s: float = 0.0
    shared_token_s: float = 0.0
    internode_bandwidth: float | None = None
    """Bytes/s of a link between nodes (None: every rank in one node)."""
    gpus_per_node: int | None = None
    cores: float | None = None
    idle_load: float = 0.0
    """Share of a core each waiting rank takes by polling (with ``cores``)."""
    comm_uses_cores: bool = False
    """Dispatch, combine and collectives compete for the cores (CPU: they are copies done by
    the processor)."""
    host_barrier: bool = False
    """Sync mode's per-layer barrier is a host's while the device computes (``afd run`` on a
    GPU: the host launches a layer's attention, reaches the barrier at once, and only the
    dispatch it launches after the barrier waits for the other replicas). False: the
    barrier follows the attention's end (on the CPU the host computes)."""
    attention_share: float | None = None
    """Percent of one GPU's SMs each attention rank held (CUDA MPS) when the compute terms
    were measured; None: a whole processor per rank, and no share term."""
    ffn_share: float | None = None
    """The same for each FFN rank."""
    layers: int | None = None
    """The layer count the coefficients were measured with (CPU lumps the dense layers and
    per-step work into the attention terms, so they only hold for this count)."""
    command: str = ""
    date: str = ""
    notes: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)

    @property
    def extra_item_s(self) -> float:
        return self.ffn_item_s if self.ffn_extra_item_s is None else self.ffn_extra_item_s

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, **dataclasses.asdict(self)}

    def replace(self, **changes: Any) -> Calibration:
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in dataclasses.fields(Calibration)}
_REQUIRED = [
    f.name
    for f in dataclasses.fields(Calibration)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
]


def from_json(data: Any, where: str) -> Calibration:
    """A :class:`Calibration` from parsed JSON; :class:`SimError` naming the bad field."""
    if not isinstance(data, dict):
        raise SimError(f"{where}: a calibration file holds one JSON object")
    schema = data.get("schema")
    if schema != SCHEMA_VERSION:
        raise SimError(
            f"{where}: calibration schema {schema!r}, this afd reads schema {SCHEMA_VERSION}; "
            f"re-run afd sim calibrate"
        )
    body = {k: v for k, v in data.items() if k != "schema"}
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise SimError(f"{where}: unknown calibration field(s) {unknown}")
    missing = [k for k in _REQUIRED if k not in body]
    if missing:
        raise SimError(f"{where}: missing calibration field(s) {missing}")
    for name, value in body.items():
        if name in ("device", "preset", "dtype", "command", "date", "notes"):
            if not isinstance(value, str):
                raise SimError(f"{where}: {name} must be a string")
        elif name in ("sources", "fit"):
            if not isinstance(value, dict):
                raise SimError(f"{where}: {name} must be an object")
        elif name in ("comm_uses_cores", "host_barrier"):
            if not isinstance(value, bool):
                raise SimError(f"{where}: {name} must be true or false")
        elif value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise SimError(f"{where}: {name} must be a non-negative number, got {value!r}")
    for name in ("dispatch_bandwidth", "combine_bandwidth", "collective_bandwidth"):
        if not body[name] > 0:
            raise SimError(f"{where}: {name} must be > 0 bytes/s")
    if body.get("cores") is not None and not body["cores"] > 0:
        raise SimError(f"{where}: cores must be > 0 (or null: one processor per rank)")
    shares = (body.get("attention_share"), body.get("ffn_share"))
    if (shares[0] is None) != (shares[1] is None):
        raise SimError(f"{where}: attention_share and ffn_share are both set or both null")
    for name, share in zip(("attention_share", "ffn_share"), shares, strict=True):
        if share is not None and not 0 < share <= 100:
            raise SimError(f"{where}: {name} is a percent of the SMs, in (0, 100]: {share}")
    return Calibration(**body)


SHARE_EVIDENCE = (
    "on one H200 under CUDA MPS (2026-12-03, afd bench prefill, quick size), ranks at 50 % "
    "of the SMs computed 1.8-2.2x as fast as at 25 % (attention and FFN, v2-lite and "
    "v3-slice; the 50 % runs had two ranks on the GPU, the 25 % runs three or four sharing "
    "its HBM, so share and contention are measured together)"
)


def share_scale(calibrated: float | None, share: float | None, option: str) -> float:
    """How many times as long a rank's compute takes at ``share`` percent of the SMs as at
    the calibration's ``calibrated`` percent: ``calibrated / share`` (compute and weight
    reads in proportion to the SMs a rank holds; :data:`SHARE_EVIDENCE`). 1 when ``share``
    is None (the calibration's own); :class:`SimError` naming ``option`` when the
    calibration has no shares or ``share`` is not a percent."""
    if share is None:
        return 1.0
    if not (math.isfinite(share) and 0 < share <= 100):
        raise SimError(f"{option} is a percent of the GPU's SMs, in (0, 100]: got {share:g}")
    if calibrated is None:
        raise SimError(
            f"{option} needs a calibration measured under CUDA MPS shares (this one has "
            f"none: each rank is a whole processor); calibrate from runs with --share-gpus"
        )
    return calibrated / share


SHIPPED = (
    "cpu-tiny",
    "h200-v3",
    "h200-v2-lite",
    "h200-mps-v3",
    "h200-mps-quick-v3",
    "h100-mps-v2-lite-27",
    "h200-mps-v3-full",
    "h100-mps-v2-lite-27-fixed",
)
"""Calibration files in the package (``afd_tools/sim/calibrations/NAME.json``)."""


def load(name_or_path: str) -> Calibration:
    """A shipped calibration by name (:data:`SHIPPED`) or a file path."""
    if name_or_path in SHIPPED:
        text = (
            resources.files("afd_tools.sim")
            .joinpath("calibrations")
            .joinpath(f"{name_or_path}.json")
            .read_text()
        )
        where = f"calibration {name_or_path}"
    else:
        path = Path(name_or_path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise SimError(
                f"cannot read calibration {path}: {exc.strerror or exc} (shipped ones: "
                f"{', '.join(SHIPPED)})"
            ) from None
        where = str(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SimError(f"{where}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    return from_json(data, where)


@dataclass(frozen=True)
class Shapes:
    """What the cost model needs of a model config."""

    hidden: int
    layers: int
    moe: tuple[bool, ...]
    """Per layer: an MoE layer (else dense)."""
    experts: int
    topk: int
    shared_experts: int
    dtype_bytes: int

    @classmethod
    def of(cls, config: DeepseekConfig, dtype: str) -> Shapes:
        layers = config.num_hidden_layers
        return cls(
            hidden=config.hidden_size,
            layers=layers,
            moe=tuple(config.is_moe_layer(i) for i in range(layers)),
            experts=config.n_routed_experts,
            topk=config.num_experts_per_tok,
            shared_experts=config.n_shared_experts,
            dtype_bytes=DTYPE_BYTES[dtype],
        )

    @property
    def moe_layers(self) -> int:
        return sum(self.moe)


@dataclass(frozen=True)
class Wire:
    """How a layer's rows cross between the roles."""

    format: str = "per_rank"
    """``per_rank`` (a token's row once per FFN rank it needs) or ``per_choice``."""
    combine_reduce: str = "ffn"
    shared: str = "attention"
    """Where shared experts run: ``attention`` or ``ffn``."""


def rank_hit_probability(experts: int, topk: int, ffn_ranks: int) -> float:
    """Probability that a token with uniform top-k routing needs a given FFN rank (which
    holds ``experts / ffn_ranks`` experts)."""
    local = experts / ffn_ranks
    if local >= experts:
        return 1.0
    # P(none of the k choices is local) for k distinct draws without replacement.
    miss = 1.0
    for j in range(topk):
        miss *= max(0.0, (experts - local - j) / (experts - j))
    return 1.0 - miss


def experts_touched(local_experts: float, rows_per_expert: float) -> float:
    """Expected local experts with at least one row when ``rows_per_expert`` rows per
    expert arrive uniformly (a Poisson approximation)."""
    return local_experts * (1.0 - math.exp(-rows_per_expert))


class CostModel:
    """The formulas of the module docstring for one configuration (A, F, shapes, wire)."""

    def __init__(
        self,
        cal: Calibration,
        shapes: Shapes,
        attention_ranks: int,
        ffn_ranks: int,
        wire: Wire,
        attention_scale: float = 1.0,
        ffn_scale: float = 1.0,
    ) -> None:
        """``attention_scale`` and ``ffn_scale`` multiply each role's compute
        (:func:`share_scale`)."""
        self.cal = cal
        self.attention_scale = attention_scale
        self.ffn_scale = ffn_scale
        self.shapes = shapes
        self.wire = wire
        self.attention_ranks = attention_ranks
        self.ffn_ranks = ffn_ranks
        k, e, f = shapes.topk, shapes.experts, ffn_ranks
        self.local_experts = e / f
        self.routed_rows_per_token = k / f
        """Routed rows an FFN rank computes per attention token (uniform routing)."""
        hit = rank_hit_probability(e, k, f)
        self.sent_rows_per_token = k / f if wire.format == "per_choice" else hit
        """Rows a token puts on the wire to one FFN rank."""
        self.reply_rows_per_token = (
            hit if wire.format == "per_rank" and wire.combine_reduce == "ffn" else k / f
        )
        self.shared_on_ffn = wire.shared == "ffn"
        row = shapes.hidden * shapes.dtype_bytes
        self.row_bytes = row
        self.dispatch_row_bytes = row + META_BYTES_PER_ROW
        self.shared_ffn_tokens_per_token = 1.0 / f if self.shared_on_ffn else 0.0
        self.same_node_fraction = self._same_node_fraction()

    def _same_node_fraction(self) -> float:
        """Of one attention replica's FFN peers, the mean fraction in its own node (ranks
        placed attention first, ``gpus_per_node`` to a node)."""
        per_node = self.cal.gpus_per_node
        a, f = self.attention_ranks, self.ffn_ranks
        if per_node is None or self.cal.internode_bandwidth is None or a + f <= per_node:
            return 1.0
        same = 0
        for r in range(a):
            node = r // per_node
            same += sum(1 for j in range(f) if (a + j) // per_node == node)
        return same / (a * f)

    # attention side -----------------------------------------------------------------
    def attention_s(self, tokens: float, square: float, layer: int) -> float:
        cal = self.cal
        cost = cal.attn_fixed_s + cal.attn_token_s * tokens + cal.attn_square_s * square
        if not self.shapes.moe[layer]:
            cost += cal.dense_token_s * tokens
        elif not self.shared_on_ffn:
            cost += cal.shared_token_s * tokens * self.shapes.shared_experts
        return cost * self.attention_scale

    def _link_s(self, total_bytes: float, bandwidth: float) -> float:
        """Seconds for ``total_bytes`` spread evenly over the FFN peers."""
        near = self.same_node_fraction
        seconds = total_bytes * near / bandwidth
        if near < 1.0:
            assert self.cal.internode_bandwidth is not None
            seconds += total_bytes * (1.0 - near) / self.cal.internode_bandwidth
        return seconds

    def dispatch_bytes(self, tokens: float) -> float:
        rows = tokens * (self.sent_rows_per_token + self.shared_ffn_tokens_per_token)
        return rows * self.ffn_ranks * self.dispatch_row_bytes

    def combine_bytes(self, tokens: float) -> float:
        rows = tokens * (self.reply_rows_per_token + self.shared_ffn_tokens_per_token)
        return rows * self.ffn_ranks * self.row_bytes

    def dispatch_s(self, tokens: float) -> float:
        cal = self.cal
        return cal.dispatch_latency_s + self._link_s(
            self.dispatch_bytes(tokens), cal.dispatch_bandwidth
        )

    def combine_s(self, tokens: float) -> float:
        cal = self.cal
        return cal.combine_latency_s + self._link_s(
            self.combine_bytes(tokens), cal.combine_bandwidth
        )

    # FFN side ------------------------------------------------------------------------
    def ffn_rows(self, tokens: float) -> float:
        """Rows one FFN rank computes for an item of ``tokens`` attention tokens."""
        return tokens * self.routed_rows_per_token

    def ffn_s(self, tokens: float, items: int) -> float:
        """One FFN rank serving ``items`` work items of ``tokens`` attention tokens in all."""
        cal = self.cal
        rows = self.ffn_rows(tokens)
        touched = experts_touched(self.local_experts, rows / self.local_experts)
        cost = cal.ffn_item_s + (items - 1) * cal.extra_item_s
        cost += cal.ffn_expert_s * touched + cal.ffn_row_s * rows
        if self.shared_on_ffn:
            cost += (
                cal.shared_token_s
                * tokens
                * self.shared_ffn_tokens_per_token
                * (self.shapes.shared_experts)
            )
        return cost * self.ffn_scale

    # colocated -----------------------------------------------------------------------
    def monolithic_moe_s(self, tokens: float) -> float:
        """Colocated DP: one process computes every routed expert of its own tokens."""
        cal = self.cal
        rows = tokens * self.shapes.topk
        e = self.shapes.experts
        touched = experts_touched(e, rows / e)
        return cal.ffn_item_s + cal.ffn_expert_s * touched + cal.ffn_row_s * rows

    def expert_parallel_moe_s(self, tokens_all: float, world: int) -> float:
        """Colocated DP+EP: one of ``world`` ranks computes its experts' rows of every rank's
        ``tokens_all`` tokens."""
        cal = self.cal
        rows = tokens_all * self.shapes.topk / world
        local = self.shapes.experts / world
        touched = experts_touched(local, rows / local)
        return cal.ffn_item_s + cal.ffn_expert_s * touched + cal.ffn_row_s * rows

    def collective_s(self, padded_tokens: float, world: int, element_bytes: int) -> float:
        """One all_gather (or reduce_scatter) of ``padded_tokens`` rows per rank."""
        cal = self.cal
        if world <= 1:
            return 0.0
        peer_bytes = (world - 1) * padded_tokens * self.shapes.hidden * element_bytes
        bandwidth = cal.collective_bandwidth
        per_node = cal.gpus_per_node
        if per_node is not None and cal.internode_bandwidth is not None and world > per_node:
            bandwidth = min(bandwidth, cal.internode_bandwidth)  # a ring is as slow as its link
        return cal.collective_latency_s + peer_bytes / bandwidth
