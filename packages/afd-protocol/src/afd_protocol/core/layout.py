"""Window and slot geometry: where every byte lives, for both directions.

A rank's *window* is one contiguous buffer that its peers write into::

    window = [ flags[num_regions][ring_depth] | abort[num_regions] | slot(0,0) | slot(0,1) | ... ]
    slot   = [ header | route_index | route_ids | route_weights | routed_rows | routed_scales
               | shared_rows | shared_scales ]

Every field starts on a 256-byte boundary. A sender writes only the region numbered by
its own role rank (its slots, its flag words and its abort word), so no two writers
ever touch the same bytes and no remote atomics are needed. The same slot layout is
used for dispatch (attention -> FFN) and for replies (FFN -> attention), so one
geometry sizes both directions.

Two wire formats (:class:`WireFormat`, part of the geometry):

* ``per_choice``: one routed row per (token, expert) partial each way, grouped by local
  expert; the weights stay on the attention side, which applies them at combine.
* ``per_rank``: a token's row travels once to every FFN rank that holds any of its
  experts, with its ``topk`` local expert ids (-1: not here) and weights in ``route_ids``
  and ``route_weights``. The FFN rank expands the rows to its experts. With
  ``combine_reduce="ffn"`` it also sums each token's partials with the weights (fp32) and
  replies one row per token; with ``"attention"`` it replies one row per partial, in the
  ``per_choice`` order, and the attention side weights them. At top-k 6 and one FFN rank
  this moves six times fewer dispatch rows (and, reduced on the FFN, reply rows).

Capacities are fixed at initialisation:

* ``token_cap = max_num_batched_tokens``
* ``routed_cap``, the rows a slot's ``routed_rows`` field holds: for ``per_choice``
  ``ceil(ceil(token_cap * topk / F) * routed_cap_multiplier)``, at most
  ``token_cap * topk`` (the worst case, every partial on one rank, is multiplier = F); for
  ``per_rank`` reduced on the FFN ``token_cap`` (no routing can overflow it); for
  ``per_rank`` reduced on the attention side the larger of the two
* ``shared_cap = ceil(token_cap / F)`` when shared experts run on the FFN side, else 0

A batch that does not fit raises :class:`CapacityError` naming the numbers, before
anything is written. Both roles must derive the same geometry; :meth:`WindowLayout.describe`
and :func:`check_same_geometry` make the cross-role handshake name the first parameter
that differs.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from afd_protocol.core.errors import CapacityError, TopologyError
from afd_protocol.core.header import HEADER_FIXED_WORDS, PROTOCOL_VERSION, HeaderLimits, MessageKind
from afd_protocol.core.topology import Topology

ALIGN = 256
"""Alignment of every field and slot, in bytes."""

DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "int32": 4,
    "uint8": 1,
}
"""Element sizes of the types a slot field can hold, by their torch attribute name."""

ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")
LOW_PRECISION_PAYLOADS = ("float8_e4m3fn", "float8_e5m2", "int8")


def align_up(nbytes: int, alignment: int = ALIGN) -> int:
    return -(-nbytes // alignment) * alignment


class SharedPlacement(str, enum.Enum):
    """Where shared experts run.

    ``attention`` (seed 002): the attention rank computes them locally, overlapped with
    the remote routed work; nothing shared travels. ``ffn`` (seed 000): tokens are split
    round-robin over the FFN ranks, which compute and return the shared branch.
    """

    ATTENTION = "attention"
    FFN = "ffn"


class WireFormat(str, enum.Enum):
    """How routed rows travel (see the module docstring)."""

    PER_CHOICE = "per_choice"
    PER_RANK = "per_rank"


class CombineReduce(str, enum.Enum):
    """Who weights and sums a token's partials: the ``attention`` side at combine, or the
    ``ffn`` side before replying (``per_rank`` only)."""

    ATTENTION = "attention"
    FFN = "ffn"


@dataclass(frozen=True)
class FieldSpec:
    """One field of a slot: byte offset inside the slot, size, element type and shape."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SlotLayout:
    """Geometry of one slot, derived from the topology and the model's batch limits."""

    topology: Topology
    hidden_size: int
    max_num_batched_tokens: int
    topk: int
    dtype: str = "bfloat16"
    """Activation dtype of routed and shared rows (dispatch rows and replies)."""
    payload_dtype: str | None = None
    """Optional low-precision dispatch payload (fp8/int8) with one fp32 scale per row."""
    routed_cap_multiplier: float = 2.0
    shared_placement: SharedPlacement = SharedPlacement.ATTENTION
    wire_format: WireFormat = WireFormat.PER_CHOICE
    combine_reduce: CombineReduce = CombineReduce.ATTENTION

    token_cap: int = field(init=False)
    routed_cap: int = field(init=False)
    shared_cap: int = field(init=False)
    header_words: int = field(init=False)
    fields: tuple[FieldSpec, ...] = field(init=False, repr=False)
    slot_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self._validate()
        topo = self.topology
        f = topo.num_ffn_ranks
        token_cap = self.max_num_batched_tokens
        even_split = math.ceil(token_cap * self.topk / f)
        per_choice_cap = min(
            math.ceil(even_split * self.routed_cap_multiplier), token_cap * self.topk
        )
        per_rank = self.wire_format is WireFormat.PER_RANK
        if not per_rank:
            routed_cap = per_choice_cap
        elif self.combine_reduce is CombineReduce.FFN:
            routed_cap = token_cap
        else:
            routed_cap = max(token_cap, per_choice_cap)
        route_rows = token_cap if per_rank else 0
        shared_cap = math.ceil(token_cap / f) if self.shared_placement is SharedPlacement.FFN else 0
        header_words = HEADER_FIXED_WORDS + topo.expert_placement.max_local_experts
        row_bytes = self.hidden_size * DTYPE_ITEMSIZE[self.dtype]
        scales = self.payload_dtype is not None

        specs: list[FieldSpec] = []
        offset = 0

        def add(name: str, dtype: str, shape: tuple[int, ...]) -> None:
            nonlocal offset
            nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
            specs.append(FieldSpec(name, offset, nbytes, dtype, shape))
            offset = align_up(offset + nbytes)

        add("header", "int32", (header_words,))
        add("route_index", "int32", (routed_cap,))
        add("route_ids", "int32", (route_rows, self.topk))
        add("route_weights", "float32", (route_rows, self.topk))
        # Rows are sized for the activation dtype, which is at least as wide as any
        # low-precision payload: the reply into the same slot carries full-width rows.
        add("routed_rows", "uint8", (routed_cap, row_bytes))
        add("routed_scales", "float32", (routed_cap if scales else 0,))
        add("shared_rows", "uint8", (shared_cap, row_bytes))
        add("shared_scales", "float32", (shared_cap if scales else 0,))

        object.__setattr__(self, "token_cap", token_cap)
        object.__setattr__(self, "routed_cap", routed_cap)
        object.__setattr__(self, "shared_cap", shared_cap)
        object.__setattr__(self, "header_words", header_words)
        object.__setattr__(self, "fields", tuple(specs))
        object.__setattr__(self, "slot_bytes", align_up(max(offset, ALIGN)))

    def _validate(self) -> None:
        if self.hidden_size < 1:
            raise TopologyError(f"hidden_size must be >= 1, got {self.hidden_size}")
        if self.max_num_batched_tokens < 1:
            raise TopologyError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 1 <= self.topk <= self.topology.num_experts:
            raise TopologyError(
                f"topk ({self.topk}) must be in [1, num_experts={self.topology.num_experts}]"
            )
        if self.dtype not in ACTIVATION_DTYPES:
            raise TopologyError(
                f"dtype {self.dtype!r} is not supported; use one of {list(ACTIVATION_DTYPES)}"
            )
        if self.payload_dtype is not None and self.payload_dtype not in LOW_PRECISION_PAYLOADS:
            raise TopologyError(
                f"payload_dtype {self.payload_dtype!r} is not a low-precision payload; use "
                f"None (send {self.dtype}) or one of {list(LOW_PRECISION_PAYLOADS)}"
            )
        if not (math.isfinite(self.routed_cap_multiplier) and self.routed_cap_multiplier >= 1.0):
            raise TopologyError(
                f"routed_cap_multiplier must be a finite number >= 1.0 (1.0 fits a perfectly "
                f"balanced router, {self.topology.num_ffn_ranks} fits any routing), got "
                f"{self.routed_cap_multiplier}"
            )
        for name, kind in (
            ("shared_placement", SharedPlacement),
            ("wire_format", WireFormat),
            ("combine_reduce", CombineReduce),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    choices = " or ".join(repr(k.value) for k in kind)
                    raise TopologyError(f"{name} {value!r} must be {choices}") from None
        if (
            self.wire_format is WireFormat.PER_CHOICE
            and self.combine_reduce is not CombineReduce.ATTENTION
        ):
            raise TopologyError(
                "combine_reduce='ffn' needs wire_format='per_rank' (per_choice rows carry no "
                "weights for the FFN side to reduce with)"
            )

    # ---- fields -----------------------------------------------------------------

    def field(self, name: str) -> FieldSpec:
        for spec in self.fields:
            if spec.name == name:
                return spec
        raise KeyError(f"no slot field {name!r}; fields are {[s.name for s in self.fields]}")

    @property
    def row_bytes(self) -> int:
        return self.hidden_size * DTYPE_ITEMSIZE[self.dtype]

    def num_local_experts(self, ffn_rank: int) -> int:
        return len(self.topology.local_experts(ffn_rank))

    def header_limits(
        self,
        kind: MessageKind,
        ffn_rank: int,
        num_layers: int | None = None,
        num_stages: int | None = None,
    ) -> HeaderLimits:
        """What a receiver checks a header against.

        A dispatch is received by FFN rank ``ffn_rank`` from an attention rank; a reply
        is received by an attention rank from FFN rank ``ffn_rank``. Either way the
        header carries one count per local expert of ``ffn_rank``.
        """
        topo = self.topology
        dispatch = kind is MessageKind.DISPATCH
        senders = topo.num_attention_ranks if dispatch else topo.num_ffn_ranks
        return HeaderLimits(
            token_cap=self.token_cap,
            routed_cap=self.routed_cap,
            shared_cap=self.shared_cap,
            num_counts=self.num_local_experts(ffn_rank),
            num_src_ranks=senders,
            num_layers=num_layers,
            num_stages=num_stages,
            topk=self.topk,
            rows_per_token=self.rows_per_token(kind),
        )

    @property
    def per_rank(self) -> bool:
        return self.wire_format is WireFormat.PER_RANK

    def rows_per_token(self, kind: MessageKind) -> bool:
        """Whether messages of ``kind`` carry one row per token (else one per partial)."""
        if not self.per_rank:
            return False
        return kind is MessageKind.DISPATCH or self.combine_reduce is CombineReduce.FFN

    def slot_rows(self, partials: int, token_rows: int) -> int:
        """The most rows either direction puts into one slot, for a destination that gets
        ``partials`` (token, expert) partials of ``token_rows`` distinct tokens."""
        if not self.per_rank:
            return partials
        if self.combine_reduce is CombineReduce.FFN:
            return token_rows
        return max(partials, token_rows)

    # ---- capacity ---------------------------------------------------------------

    def check_capacity(
        self, num_tokens: int, routed_rows: int = 0, shared_rows: int = 0, *, dest: int = -1
    ) -> None:
        """Raise :class:`CapacityError` if a batch does not fit one slot."""
        where = f" for FFN rank {dest}" if dest >= 0 else ""
        if num_tokens > self.token_cap:
            raise CapacityError(
                f"batch of {num_tokens} tokens exceeds token_cap={self.token_cap} "
                f"(max_num_batched_tokens); split the batch or raise max_num_batched_tokens"
            )
        if routed_rows > self.routed_cap:
            needed = routed_rows / math.ceil(
                self.token_cap * self.topk / self.topology.num_ffn_ranks
            )
            raise CapacityError(
                f"{routed_rows} routed rows{where} exceed routed_cap={self.routed_cap} "
                f"(token_cap={self.token_cap}, topk={self.topk}, "
                f"F={self.topology.num_ffn_ranks}, routed_cap_multiplier="
                f"{self.routed_cap_multiplier}); this routing needs a multiplier of at least "
                f"{needed:.2f} (at most {self.topology.num_ffn_ranks} is ever needed)"
            )
        if shared_rows > self.shared_cap:
            raise CapacityError(
                f"{shared_rows} shared rows{where} exceed shared_cap={self.shared_cap} "
                f"(shared_placement={self.shared_placement.value})"
            )

    # ---- windows and handshake --------------------------------------------------

    def window(self, ring_depth: int = 1, num_regions: int | None = None) -> WindowLayout:
        regions = self.topology.num_regions if num_regions is None else num_regions
        return WindowLayout(self, regions, ring_depth)

    def window_bytes(self, num_regions: int, ring_depth: int) -> int:
        return self.window(ring_depth, num_regions).total_bytes

    def describe(self) -> dict[str, object]:
        """Every parameter the geometry depends on, in a stable order."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            **self.topology.describe(),
            "hidden_size": self.hidden_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "topk": self.topk,
            "dtype": self.dtype,
            "payload_dtype": self.payload_dtype,
            "routed_cap_multiplier": self.routed_cap_multiplier,
            "shared_placement": self.shared_placement.value,
            "wire_format": self.wire_format.value,
            "combine_reduce": self.combine_reduce.value,
            "routed_cap": self.routed_cap,
            "shared_cap": self.shared_cap,
            "slot_bytes": self.slot_bytes,
        }


@dataclass(frozen=True)
class WindowLayout:
    """A whole window: control words for every (region, ring) then the slots."""

    slot: SlotLayout
    num_regions: int
    ring_depth: int

    flags_offset: int = field(init=False)
    abort_offset: int = field(init=False)
    slots_offset: int = field(init=False)
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.num_regions < self.slot.topology.num_regions:
            raise TopologyError(
                f"num_regions ({self.num_regions}) must be at least max(A, F) = "
                f"{self.slot.topology.num_regions}"
            )
        if self.ring_depth < 1:
            raise TopologyError(
                f"ring_depth must be >= 1 (one slot per in-flight stage), got {self.ring_depth}"
            )
        flags = 0
        abort = align_up(flags + 4 * self.num_regions * self.ring_depth)
        slots = align_up(abort + 4 * self.num_regions)
        total = slots + self.num_regions * self.ring_depth * self.slot.slot_bytes
        object.__setattr__(self, "flags_offset", flags)
        object.__setattr__(self, "abort_offset", abort)
        object.__setattr__(self, "slots_offset", slots)
        object.__setattr__(self, "total_bytes", total)

    def _check(self, region: int, ring: int) -> None:
        if not 0 <= region < self.num_regions:
            raise TopologyError(f"region {region} is outside [0, {self.num_regions})")
        if not 0 <= ring < self.ring_depth:
            raise TopologyError(f"ring {ring} is outside [0, {self.ring_depth})")

    def flag_index(self, region: int, ring: int) -> int:
        """Index of the (region, ring) flag in the int32 flag array."""
        self._check(region, ring)
        return region * self.ring_depth + ring

    def flag_offset(self, region: int, ring: int) -> int:
        return self.flags_offset + 4 * self.flag_index(region, ring)

    def abort_word_offset(self, region: int) -> int:
        self._check(region, 0)
        return self.abort_offset + 4 * region

    def slot_offset(self, region: int, ring: int) -> int:
        self._check(region, ring)
        return self.slots_offset + (region * self.ring_depth + ring) * self.slot.slot_bytes

    def field_offset(self, region: int, ring: int, name: str) -> int:
        return self.slot_offset(region, ring) + self.slot.field(name).offset

    def describe(self) -> dict[str, object]:
        return {
            **self.slot.describe(),
            "num_regions": self.num_regions,
            "ring_depth": self.ring_depth,
            "window_bytes": self.total_bytes,
        }

    def digest(self) -> str:
        """A stable hash of the geometry, equal on both roles iff they agree."""
        return geometry_digest(self.describe())


def geometry_digest(description: Mapping[str, object]) -> str:
    blob = json.dumps(description, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_same_geometry(
    mine: Mapping[str, object], theirs: Mapping[str, object], *, peer: str = "peer"
) -> None:
    """Raise :class:`TopologyError` naming the first parameter on which two roles differ."""
    for key in list(mine) + [k for k in theirs if k not in mine]:
        a, b = mine.get(key, "<missing>"), theirs.get(key, "<missing>")
        if a != b:
            raise TopologyError(
                f"window geometry differs from {peer}'s: {key} is {a!r} here but {b!r} there; "
                f"start both roles with the same AFD configuration"
            )
