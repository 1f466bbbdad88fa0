"""Expert backends: how a rank computes its routed experts on grouped rows.

Every backend implements :class:`ExpertBackend` and is selected by name. Built in:

* ``reference`` -- a per-expert loop over the row ids expanded from the group list.
  Plain, slow, obviously right; every other backend is tested against it.
* ``grouped_mm`` -- two ``torch._grouped_mm`` calls (gate/up, then down) over the
  group offsets. It runs where the installed torch provides that operator for the
  device and dtype; anywhere else it raises :class:`BackendUnavailable` saying so.
* ``triton`` -- two launches of a Triton grouped GEMM whose rows per expert are read on the
  device (:mod:`afd_models.triton_grouped_gemm`: no host read, so it can be captured in a
  CUDA graph; it can also select a layer of stacked weights by a device index). Triton is
  imported when the backend is selected; without it, :class:`BackendUnavailable` says so.

Other backends register themselves by name with :func:`register_expert_backend`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

import torch
from torch.nn import functional as nnf

from afd_models.errors import BackendUnavailable
from afd_models.experts import ExpertWeights, GroupedRows


class ExpertBackend(abc.ABC):
    """Computes ``expert(row)`` for every grouped row (unit weight) on one rank."""

    name: ClassVar[str]

    @abc.abstractmethod
    def forward(self, work: GroupedRows, experts: ExpertWeights) -> torch.Tensor:
        """``[N, H]`` outputs in the rows' dtype, row ``i`` by the expert of row ``i``."""

    def __call__(self, work: GroupedRows, experts: ExpertWeights) -> torch.Tensor:
        if work.group_list.numel() != experts.num_local_experts:
            raise ValueError(
                f"the group list has {work.group_list.numel()} entries but layer "
                f"{experts.layer} holds {experts.num_local_experts} local experts"
            )
        if work.rows.dtype != experts.gate_up.dtype:
            raise TypeError(
                f"rows are {work.rows.dtype} but the experts are {experts.gate_up.dtype}"
            )
        if work.num_rows == 0:
            return work.rows.new_empty(0, work.rows.shape[1])
        return self.forward(work, experts)


class ReferenceBackend(ExpertBackend):
    """One expert at a time, on the rows whose expanded id names it."""

    name = "reference"

    def forward(self, work: GroupedRows, experts: ExpertWeights) -> torch.Tensor:
        ids = work.expert_ids()
        inter = experts.intermediate_size
        out = torch.zeros_like(work.rows)
        for local in range(experts.num_local_experts):
            index = (ids == local).nonzero().squeeze(1)
            if index.numel() == 0:
                continue
            x = work.rows.index_select(0, index)
            gate_up = nnf.linear(x, experts.gate_up[local])
            hidden = nnf.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out.index_copy_(0, index, nnf.linear(hidden, experts.down[local]))
        return out


class GroupedMMBackend(ExpertBackend):
    """``torch._grouped_mm`` over the group offsets: one launch per projection."""

    name = "grouped_mm"

    def __init__(self) -> None:
        if not hasattr(torch, "_grouped_mm"):
            raise BackendUnavailable(
                f"expert backend 'grouped_mm' needs torch._grouped_mm, which torch "
                f"{torch.__version__} does not have; use backend 'reference' or a newer torch"
            )

    def forward(self, work: GroupedRows, experts: ExpertWeights) -> torch.Tensor:
        rows = work.rows
        offsets = torch.cumsum(work.group_list.to(rows.device), 0).to(torch.int32)
        inter = experts.intermediate_size
        try:
            gate_up = torch._grouped_mm(rows, experts.gate_up.transpose(1, 2), offs=offsets)
            hidden = (nnf.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
            out: torch.Tensor = torch._grouped_mm(
                hidden, experts.down.transpose(1, 2), offs=offsets
            )
        except (RuntimeError, NotImplementedError) as exc:
            raise BackendUnavailable(
                f"expert backend 'grouped_mm': torch {torch.__version__} cannot run "
                f"torch._grouped_mm on {rows.device.type} with {rows.dtype} ({exc}); use "
                f"backend 'reference', or another dtype/device"
            ) from exc
        return out


class TritonGroupedBackend(ExpertBackend):
    """Two launches of the Triton grouped GEMM (gate/up, then down), SwiGLU between them in
    torch; the group list stays on the device."""

    name = "triton"

    def __init__(self) -> None:
        try:
            from afd_models import triton_grouped_gemm
        except ImportError as exc:
            raise BackendUnavailable(
                f"expert backend 'triton' needs Triton ({exc}): pip install triton, or use "
                f"backend 'reference' or 'grouped_mm'"
            ) from exc
        self._step = triton_grouped_gemm.expert_step

    def forward(self, work: GroupedRows, experts: ExpertWeights) -> torch.Tensor:
        counts = work.group_list.to(work.rows.device)
        return self._step(work.rows, experts.gate_up, experts.down, counts)


BackendFactory = Callable[[], ExpertBackend]
_REGISTRY: dict[str, BackendFactory] = {}


def register_expert_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``factory`` available as backend ``name``.

    The factory runs when the backend is selected, so it may import optional packages
    lazily and raise :class:`BackendUnavailable` with install guidance.
    """
    if name in _REGISTRY and not replace:
        raise ValueError(f"expert backend {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = factory


def unregister_expert_backend(name: str) -> None:
    """Remove backend ``name`` (tests, or an adapter that is being unloaded)."""
    _REGISTRY.pop(name, None)


def expert_backend_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_expert_backend(backend: str | ExpertBackend) -> ExpertBackend:
    """The backend registered as ``backend`` (an instance is passed through)."""
    if isinstance(backend, ExpertBackend):
        return backend
    factory = _REGISTRY.get(backend)
    if factory is None:
        raise BackendUnavailable(
            f"unknown expert backend {backend!r}; registered: {list(expert_backend_names())}"
        )
    return factory()


register_expert_backend(ReferenceBackend.name, ReferenceBackend)
register_expert_backend(GroupedMMBackend.name, GroupedMMBackend)
register_expert_backend(TritonGroupedBackend.name, TritonGroupedBackend)
