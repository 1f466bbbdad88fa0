"""Where ``afd run`` puts its ranks, and the defaults that follow from the device.

On CUDA every process gets its own GPU, attention replicas first (GPU ``r``), then the FFN
ranks (GPU ``A + f``) -- the order NVSHMEM's world uses, so the transport and the model
agree without being told. Colocated DP+EP uses the same GPUs, rank ``g`` on GPU ``g``.
With ``--share-gpus`` several processes may share a GPU (a functional check on a machine
with fewer GPUs than ranks; its timings measure the sharing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_tools.run.workload import WorkloadError

DEVICE_DEFAULTS = {
    "cpu": {"dtype": "float32", "backend": "reference", "transport": "shm", "colocated": "dp"},
    "cuda": {
        "dtype": "bfloat16",
        "backend": "grouped_mm",
        "transport": "nvshmem",
        "colocated": "dp-ep",
    },
}
"""Per device, what ``--dtype``, ``--backend``, ``--transport`` and ``--colocated`` mean when
not given (on CUDA ``grouped_mm`` only for bfloat16, which torch's grouped GEMM needs; the
reference backend otherwise)."""


@dataclass(frozen=True)
class Placement:
    """The device of every rank of both launches."""

    kind: str
    """``cpu`` or ``cuda``."""
    attention: tuple[str, ...]
    ffn: tuple[str, ...]
    colocated: tuple[str, ...]
    """Colocated DP+EP ranks (``A + F`` of them), when that mode runs."""
    shared: bool
    """Several ranks on one GPU."""

    @property
    def exchange(self) -> str:
        """The collectives backend of colocated DP+EP: NCCL where every rank has its own GPU
        (it refuses two ranks on one), gloo otherwise."""
        return "nccl" if self.kind == "cuda" and not self.shared else "gloo"


def resolve_device(requested: str) -> str:
    """``auto`` is ``cuda`` when a CUDA GPU is visible, else ``cpu``."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise WorkloadError(
            "--device cuda: torch sees no CUDA GPU (a CPU build of torch, or no driver); use "
            "--device cpu"
        )
    return requested


def place(kind: str, attention: int, ffn: int, share_gpus: bool) -> Placement:
    """Every rank's device, or a :class:`WorkloadError` saying how many GPUs are missing."""
    if kind == "cpu":
        return Placement(
            "cpu", ("cpu",) * attention, ("cpu",) * ffn, ("cpu",) * (attention + ffn), False
        )
    count = torch.cuda.device_count()
    needed = attention + ffn
    if needed > count and not share_gpus:
        raise WorkloadError(
            f"--device cuda runs one process per GPU: {attention} attention + {ffn} FFN ranks "
            f"need {needed} GPUs, but {count} are visible; use fewer ranks, or add --share-gpus "
            f"to place several ranks per GPU (a functional check: timings then measure the "
            f"sharing)"
        )
    gpus = [f"cuda:{i % count}" for i in range(needed)]
    return Placement(
        "cuda", tuple(gpus[:attention]), tuple(gpus[attention:]), tuple(gpus), needed > count
    )
