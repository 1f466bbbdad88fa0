"""The shapes and window layout of CAM's compact routed-only operators (generation G2).

Everything here is a pure function of the operators' integer arguments, computed the same
way on both roles, as the real host tiling does: if two ranks disagree on any of them the
layouts differ and the data is garbage, so the emulator refuses what the tiling refuses
and checks that every rank of a group was built with the same geometry.

Ranks: attention world ranks ``[0, A)``, FFN (``moe``) world ranks ``[A, A + M)``; FFN rank
``m`` (role index) holds the routed experts ``[m * R, (m + 1) * R)``. ``tp`` consecutive
attention ranks form one attention DP replica (CAM's "TP group"): an FFN rank serves a
replica only when all of its members have dispatched.

Window layout (logical: byte offsets are this emulator's own, not the NPU's, whose
statistics region depends on the number of vector cores). Sizes are padded to 64 bytes.

FFN rank window, one region per attention rank ``a`` at ``a * region_bytes``:

=================  ============================  =========================================
field              type                          meaning
=================  ============================  =========================================
header             int64[5]                      [0] ready = pairs + 1 (written last), [1] a,
                                                 [2] layer, [3] Q (row offset of this FFN
                                                 rank in a's combine area), [4] selected
counts             int32[R]                      (token, expert) pairs per local expert
chunk flags        int32[R]                      1 once an FFN work item took the expert
token store        rows_per_rank x row_bytes     each token at most once per FFN rank, in
                                                 token order (int8 + 32-byte trailer whose
                                                 first 4 bytes are the fp32 scale, when
                                                 quantised)
address table      int32[K * rows_per_rank]      per local expert, ascending tokens: the
                                                 token-store row to read (uint16 on the NPU,
                                                 whose 65,535 limit is enforced)
=================  ============================  =========================================

and, in its last 64 bytes, the round-robin pointer (int64: first attention rank of the
replica to scan next).

Attention rank window: the statistics its dispatch keeps at home for its combine (int32
counts ``[M, R]``, the routing digest, the in-flight word), the combine status words
(int32[M], ``Q + 1`` from each FFN rank once it sent everything), then the combine rows:
FFN rank ``m``'s replies at rows ``[Q_m, Q_m + pairs_m)``, by local expert, tokens in order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from afd_protocol import InvalidArgument

MAX_SEQ_LEN = 262144
"""The operators' largest ``max_seq_len``, and the receive capacity before scaling."""
ADDRESS_LIMIT = 65535
"""Token addresses and per-expert counters are uint16 on the NPU."""
HEADER_WORDS = 5
QUANT_TRAILER = 32
"""Bytes after each int8 row: the first four hold its fp32 dequantisation scale."""
POINTER_BYTES = 64
ALIGN = 64
STATS_DIGEST = 0
STATS_IN_FLIGHT = 1
STATS_WORDS = 2
"""int64 words before the counts in an attention window's statistics."""

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""bf16 and fp16 as on the NPU; fp32 too, so CPU runs verify against fp32 references."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def receive_capacity() -> int:
    """Rows a dispatch-receive returns at most: ``int(262144 * BATCH_SIZE_FACTOR)``.

    The binding reads ``BATCH_SIZE_FACTOR`` (a number in (0, 1], default 1) from the
    environment at every call; so does the emulator.
    """
    raw = os.environ.get("BATCH_SIZE_FACTOR", "1.0")
    try:
        factor = float(raw)
    except ValueError:
        raise InvalidArgument(f"BATCH_SIZE_FACTOR={raw!r} is not a number in (0, 1]") from None
    if not 0.0 < factor <= 1.0:
        raise InvalidArgument(f"BATCH_SIZE_FACTOR={raw} is outside (0, 1]")
    return max(1, int(MAX_SEQ_LEN * factor))


@dataclass(frozen=True)
class CamGeometry:
    """The operators' shared arguments, checked as the host tiling checks them."""

    num_attention: int
    """A: attention ranks (world ranks ``[0, A)``)."""
    num_ffn: int
    """M: FFN ranks (world ranks ``[A, A + M)``)."""
    experts_per_rank: int
    """R: routed experts on each FFN rank."""
    top_k: int
    hidden_size: int
    max_seq_len: int
    """Tokens per attention replica per dispatch, summed over its ``tp`` ranks."""
    tp_size: int
    """Attention ranks per DP replica."""
    dynamic_quant: bool
    dtype: torch.dtype
    """The activation dtype on the wire (dispatch input, combine rows)."""

    def __post_init__(self) -> None:
        a, m, r, k = self.num_attention, self.num_ffn, self.experts_per_rank, self.top_k
        if a < 1 or m < 1 or r < 1:
            raise InvalidArgument(
                f"attn_rank_num={a}, moe_rank_num={m} and route_expert_num_per_moe={r} must "
                f"all be >= 1"
            )
        if not 1 <= k <= m * r:
            raise InvalidArgument(
                f"top_k={k} must be in [1, moe_rank_num * route_expert_num_per_moe = {m * r}]"
            )
        if self.hidden_size < 1:
            raise InvalidArgument(f"hidden_size={self.hidden_size} must be >= 1")
        if not 1 <= self.tp_size <= a or a % self.tp_size:
            raise InvalidArgument(
                f"tp_size={self.tp_size} must divide attn_rank_num={a} (ranks of one "
                f"attention DP replica)"
            )
        if not self.tp_size <= self.max_seq_len <= MAX_SEQ_LEN:
            raise InvalidArgument(
                f"max_seq_len={self.max_seq_len} must be in [tp_size={self.tp_size}, {MAX_SEQ_LEN}]"
            )
        if self.rows_per_rank > ADDRESS_LIMIT:
            raise InvalidArgument(
                f"max_seq_len / tp_size = {self.rows_per_rank} tokens per attention rank "
                f"exceeds the uint16 token addresses ({ADDRESS_LIMIT}); raise tp_size or "
                f"lower max_seq_len"
            )
        if self.dtype not in ACTIVATION_DTYPES:
            raise InvalidArgument(
                f"activations must be one of {[str(d) for d in ACTIVATION_DTYPES]}, got "
                f"{self.dtype}"
            )

    # ---- ranks ----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.num_attention + self.num_ffn

    @property
    def num_groups(self) -> int:
        """Attention DP replicas."""
        return self.num_attention // self.tp_size

    @property
    def num_experts(self) -> int:
        return self.num_ffn * self.experts_per_rank

    @property
    def rows_per_rank(self) -> int:
        """Largest batch one attention rank may dispatch (``max_seq_len // tp_size``)."""
        return self.max_seq_len // self.tp_size

    def check_attention_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_attention:
            raise InvalidArgument(
                f"attn_rank_id={rank} is outside [0, attn_rank_num={self.num_attention})"
            )

    def ffn_index(self, world_rank: int) -> int:
        """The role index of FFN world rank ``world_rank`` (checked)."""
        if not self.num_attention <= world_rank < self.world_size:
            raise InvalidArgument(
                f"moe_rank_id={world_rank} is outside [attn_rank_num={self.num_attention}, "
                f"world_size={self.world_size})"
            )
        return world_rank - self.num_attention

    # ---- FFN window -------------------------------------------------------------------

    @property
    def row_bytes(self) -> int:
        """One token-store row: the activation, or int8 plus the scale trailer."""
        if self.dynamic_quant:
            return self.hidden_size + QUANT_TRAILER
        return self.hidden_size * self.dtype.itemsize

    @property
    def header_offset(self) -> int:
        return 0

    @property
    def counts_offset(self) -> int:
        return _align(8 * HEADER_WORDS)

    @property
    def flags_offset(self) -> int:
        return self.counts_offset + _align(4 * self.experts_per_rank)

    @property
    def store_offset(self) -> int:
        return self.flags_offset + _align(4 * self.experts_per_rank)

    @property
    def table_offset(self) -> int:
        return self.store_offset + _align(self.rows_per_rank * self.row_bytes)

    @property
    def region_bytes(self) -> int:
        """One attention rank's region in an FFN window."""
        return self.table_offset + _align(4 * self.top_k * self.rows_per_rank)

    @property
    def ffn_window_bytes(self) -> int:
        return self.num_attention * self.region_bytes + POINTER_BYTES

    # ---- attention window ---------------------------------------------------------------

    @property
    def stats_bytes(self) -> int:
        return _align(8 * STATS_WORDS + 4 * self.num_ffn * self.experts_per_rank)

    @property
    def status_offset(self) -> int:
        return self.stats_bytes

    @property
    def combine_offset(self) -> int:
        return self.status_offset + _align(4 * self.num_ffn)

    @property
    def combine_rows(self) -> int:
        """Reply rows an attention rank can receive: every (token, choice) of its batch."""
        return self.rows_per_rank * self.top_k

    @property
    def attention_window_bytes(self) -> int:
        return self.combine_offset + _align(
            self.combine_rows * self.hidden_size * self.dtype.itemsize
        )

    @property
    def window_bytes(self) -> int:
        """Bytes every rank's window needs (one size for all, as HCCL's buffer)."""
        return max(self.ffn_window_bytes, self.attention_window_bytes)

    def batch_info_words(self) -> int:
        """int64 words of the batch information a dispatch-receive returns."""
        return HEADER_WORDS + self.tp_size + self.experts_per_rank * self.tp_size
