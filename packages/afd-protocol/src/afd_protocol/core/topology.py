"""Who talks to whom: attention and FFN ranks, DP replicas and expert placement.

The AFD world orders attention ranks first, then FFN ranks: attention role rank ``i`` is
world rank ``i`` and FFN role rank ``j`` is world rank ``A + j``. Both roles allocate
windows of the same size, so the number of sender regions in every window is
``max(A, F)``; a sender writes only the region numbered by its own role rank.

Expert placement maps every routed expert to one FFN rank and a local expert id on that
rank. The wire groups rows by *(destination rank, local expert)*, so placement also
defines a "wire position" per expert (rank-major, then local id): sorting routed
partials by wire position yields both groupings with a single stable sort.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from afd_protocol.core.errors import TopologyError


class Role(str, enum.Enum):
    """The two roles of an AFD deployment."""

    ATTENTION = "attention"
    FFN = "ffn"

    @property
    def opposite(self) -> Role:
        return Role.FFN if self is Role.ATTENTION else Role.ATTENTION


@dataclass(frozen=True)
class ExpertPlacement:
    """Routed expert -> (FFN rank, local expert id).

    Build it with :meth:`contiguous` (the default: rank ``r`` owns a contiguous block,
    the first ``E % F`` ranks one expert more) or :meth:`from_table` (any partition).
    """

    experts_of_rank: tuple[tuple[int, ...], ...]
    """``experts_of_rank[r][l]`` is the global id of local expert ``l`` on FFN rank ``r``."""

    owner: tuple[int, ...] = field(init=False, repr=False)
    local_id: tuple[int, ...] = field(init=False, repr=False)
    wire_position: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        table = self.experts_of_rank
        if not table:
            raise TopologyError("expert placement needs at least one FFN rank")
        flat = [e for rank in table for e in rank]
        num_experts = len(flat)
        for rank, experts in enumerate(table):
            if not experts:
                raise TopologyError(
                    f"FFN rank {rank} owns no routed expert; every FFN rank must own at "
                    f"least one (use fewer FFN ranks or more experts)"
                )
        seen: dict[int, int] = {}
        for rank, experts in enumerate(table):
            for e in experts:
                if not 0 <= e < num_experts:
                    raise TopologyError(
                        f"expert id {e} on FFN rank {rank} is outside [0, {num_experts}); "
                        f"a placement table must list experts 0..{num_experts - 1} once each"
                    )
                if e in seen:
                    raise TopologyError(
                        f"expert {e} is placed on FFN rank {seen[e]} and on FFN rank {rank}; "
                        f"each expert must have exactly one owner"
                    )
                seen[e] = rank
        placed = [
            (e, rank, lid) for rank, experts in enumerate(table) for lid, e in enumerate(experts)
        ]
        # The wire order is the table's order: rank by rank, then local id by local id.
        where = {e: (rank, lid, position) for position, (e, rank, lid) in enumerate(placed)}
        by_expert = [where[e] for e in range(num_experts)]
        object.__setattr__(self, "owner", tuple(rank for rank, _, _ in by_expert))
        object.__setattr__(self, "local_id", tuple(lid for _, lid, _ in by_expert))
        object.__setattr__(self, "wire_position", tuple(pos for _, _, pos in by_expert))

    @classmethod
    def contiguous(cls, num_experts: int, num_ffn_ranks: int) -> ExpertPlacement:
        """Rank ``r`` owns a contiguous block; the first ``E % F`` ranks get one more."""
        if num_ffn_ranks < 1:
            raise TopologyError(f"num_ffn_ranks must be >= 1, got {num_ffn_ranks}")
        if num_experts < num_ffn_ranks:
            raise TopologyError(
                f"num_experts ({num_experts}) < num_ffn_ranks ({num_ffn_ranks}): every FFN "
                f"rank must own at least one routed expert; use at most {num_experts} FFN ranks"
            )
        base, extra = divmod(num_experts, num_ffn_ranks)
        table: list[tuple[int, ...]] = []
        start = 0
        for rank in range(num_ffn_ranks):
            count = base + (1 if rank < extra else 0)
            table.append(tuple(range(start, start + count)))
            start += count
        return cls(tuple(table))

    @classmethod
    def from_table(cls, experts_of_rank: Sequence[Sequence[int]]) -> ExpertPlacement:
        """Any partition of ``0..E-1`` over the FFN ranks, local ids in list order."""
        return cls(tuple(tuple(int(e) for e in rank) for rank in experts_of_rank))

    @property
    def num_experts(self) -> int:
        return len(self.owner)

    @property
    def num_ffn_ranks(self) -> int:
        return len(self.experts_of_rank)

    @property
    def experts_per_rank(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.experts_of_rank)

    @property
    def max_local_experts(self) -> int:
        return max(self.experts_per_rank)

    @property
    def rank_wire_offsets(self) -> tuple[int, ...]:
        """Prefix sum of experts per rank: rank ``r`` owns wire positions
        ``[offsets[r], offsets[r + 1])``."""
        out = [0]
        for n in self.experts_per_rank:
            out.append(out[-1] + n)
        return tuple(out)


@dataclass(frozen=True)
class Topology:
    """Rank counts, DP replicas and expert placement of one AFD deployment.

    ``attn_ranks_per_dp`` attention ranks form one data-parallel replica (its
    participants: tensor, context or sequence parallel shards). A replica's work item is
    ready for an FFN rank only when all its participants have published.
    """

    num_attention_ranks: int
    num_ffn_ranks: int
    num_experts: int
    attn_ranks_per_dp: int = 1
    placement: ExpertPlacement | None = None

    def __post_init__(self) -> None:
        a, f = self.num_attention_ranks, self.num_ffn_ranks
        if a < 1:
            raise TopologyError(f"num_attention_ranks must be >= 1, got {a}")
        if f < 1:
            raise TopologyError(f"num_ffn_ranks must be >= 1, got {f}")
        if self.attn_ranks_per_dp < 1:
            raise TopologyError(f"attn_ranks_per_dp must be >= 1, got {self.attn_ranks_per_dp}")
        if a % self.attn_ranks_per_dp:
            raise TopologyError(
                f"num_attention_ranks ({a}) is not a multiple of attn_ranks_per_dp "
                f"({self.attn_ranks_per_dp}); every DP replica needs the same number of ranks"
            )
        if self.placement is None:
            object.__setattr__(self, "placement", ExpertPlacement.contiguous(self.num_experts, f))
        placement = self.expert_placement
        if placement.num_ffn_ranks != f:
            raise TopologyError(
                f"expert placement covers {placement.num_ffn_ranks} FFN ranks but "
                f"num_ffn_ranks is {f}"
            )
        if placement.num_experts != self.num_experts:
            raise TopologyError(
                f"expert placement covers {placement.num_experts} experts but num_experts "
                f"is {self.num_experts}"
            )

    @property
    def expert_placement(self) -> ExpertPlacement:
        assert self.placement is not None  # set in __post_init__
        return self.placement

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    @property
    def num_regions(self) -> int:
        """Sender regions per window; both roles use the larger count."""
        return max(self.num_attention_ranks, self.num_ffn_ranks)

    @property
    def num_dp_replicas(self) -> int:
        return self.num_attention_ranks // self.attn_ranks_per_dp

    def world_rank(self, role: Role, role_rank: int) -> int:
        self._check_role_rank(role, role_rank)
        return role_rank if role is Role.ATTENTION else self.num_attention_ranks + role_rank

    def role_of(self, world_rank: int) -> tuple[Role, int]:
        """World rank -> (role, role rank)."""
        if not 0 <= world_rank < self.world_size:
            raise TopologyError(f"world rank {world_rank} is outside [0, {self.world_size})")
        if world_rank < self.num_attention_ranks:
            return Role.ATTENTION, world_rank
        return Role.FFN, world_rank - self.num_attention_ranks

    def rank_name(self, world_rank: int) -> str:
        """``"attention rank 0"`` / ``"ffn rank 1"``: how errors name a world rank."""
        role, rank = self.role_of(world_rank)
        return f"{role.value} rank {rank}"

    def num_role_ranks(self, role: Role) -> int:
        return self.num_attention_ranks if role is Role.ATTENTION else self.num_ffn_ranks

    def dp_replica_of(self, attention_rank: int) -> int:
        self._check_role_rank(Role.ATTENTION, attention_rank)
        return attention_rank // self.attn_ranks_per_dp

    def participants(self, replica: int) -> tuple[int, ...]:
        """Attention role ranks that together form DP replica ``replica``."""
        if not 0 <= replica < self.num_dp_replicas:
            raise TopologyError(f"DP replica {replica} is outside [0, {self.num_dp_replicas})")
        start = replica * self.attn_ranks_per_dp
        return tuple(range(start, start + self.attn_ranks_per_dp))

    def local_experts(self, ffn_rank: int) -> tuple[int, ...]:
        """Global ids of the routed experts FFN rank ``ffn_rank`` holds, by local id."""
        self._check_role_rank(Role.FFN, ffn_rank)
        return self.expert_placement.experts_of_rank[ffn_rank]

    def describe(self) -> dict[str, object]:
        """The parameters both roles must agree on, in a stable order."""
        return {
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "attn_ranks_per_dp": self.attn_ranks_per_dp,
            "num_experts": self.num_experts,
            "experts_of_rank": [list(r) for r in self.expert_placement.experts_of_rank],
        }

    def _check_role_rank(self, role: Role, role_rank: int) -> None:
        n = self.num_role_ranks(role)
        if not 0 <= role_rank < n:
            raise TopologyError(f"{role.value} rank {role_rank} is outside [0, {n})")
