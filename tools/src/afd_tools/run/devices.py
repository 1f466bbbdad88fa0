"""Where ``afd run`` puts its ranks, and the defaults that follow from the device.

On CUDA every process gets its own GPU, attention replicas first (GPU ``r``), then the FFN
ranks (GPU ``A + f``) -- the order NVSHMEM's world uses, so the transport and the model
agree without being told. With ``--share-gpus`` several processes may share a GPU (rank
``i`` on GPU ``i mod G``), under CUDA MPS (:mod:`afd_tools.run.sharing`).

The colocated baseline never shares a GPU: NCCL refuses two ranks of one communicator on
one GPU, and gloo would measure gloo. Colocated DP+EP puts one rank on each GPU the AFD
ranks use (rank ``g`` on GPU ``g``); where that is a single GPU, it is what a one-GPU user
runs instead: the monolithic model in one process (``mono``, DP1 and EP1).

Inside a launched rank, :func:`rank_device` checks the device it was given and
:func:`random_weights` draws the run's weights there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_models import RandomWeights
from afd_protocol import Connection
from afd_tools.prefill.workload import WorkloadError

DEVICE_DEFAULTS = {
    "cpu": {"dtype": "float32", "backend": "reference", "transport": "shm"},
    "cuda": {"dtype": "bfloat16", "backend": "grouped_mm", "transport": "nvshmem"},
}
"""Per device, what ``--dtype``, ``--backend`` and ``--transport`` mean when not given (on
CUDA ``grouped_mm`` only for bfloat16, which torch's grouped GEMM needs; the reference
backend otherwise). ``--colocated`` also depends on the placement: :func:`place`."""
COLOCATED = ("dp", "dp-ep", "mono")
"""The colocated baselines: dp = each attention replica computes the whole model; dp-ep =
one rank per processor, each with attention and a share of the routed experts; mono = the
monolithic model in one process."""


@dataclass(frozen=True)
class Placement:
    """The device of every rank of every launch."""

    kind: str
    """``cpu`` or ``cuda``."""
    attention: tuple[str, ...]
    ffn: tuple[str, ...]
    colocated: tuple[str, ...]
    """The devices of the colocated baseline's ranks: the attention replicas' (dp), one per
    processor (dp-ep), or the first attention replica's (mono)."""
    shared: bool
    """Several AFD ranks on one GPU."""
    colocated_mode: str = "dp"
    """Which colocated baseline runs (:data:`COLOCATED`)."""

    @property
    def exchange(self) -> str:
        """The collectives backend of colocated DP+EP: NCCL on GPUs (each rank has its own),
        gloo on the CPU; ``none`` for the baselines that exchange nothing."""
        if self.colocated_mode != "dp-ep":
            return "none"
        return "nccl" if self.kind == "cuda" else "gloo"

    @property
    def colocated_label(self) -> str:
        """The colocated baseline in words, as the report prints it."""
        if self.colocated_mode == "mono":
            where = "on one GPU" if self.kind == "cuda" else "in one process"
            return f"monolithic model {where} (DP1, EP1)"
        if self.colocated_mode == "dp-ep":
            return f"DP{len(self.colocated)}+EP over {self.exchange}"
        return f"DP{len(self.colocated)} in the attention replicas, each with the whole model"

    def gpu_ranks(self) -> dict[str, list[str]]:
        """The AFD ranks on each GPU, by device (``{"cuda:0": ["attention rank 0", ...]}``);
        empty on the CPU."""
        if self.kind != "cuda":
            return {}
        named = [(d, f"attention rank {r}") for r, d in enumerate(self.attention)]
        named += [(d, f"ffn rank {r}") for r, d in enumerate(self.ffn)]
        out: dict[str, list[str]] = {}
        for device, name in named:
            out.setdefault(device, []).append(name)
        return out


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


def place(
    kind: str,
    attention: int,
    ffn: int,
    share_gpus: bool,
    colocated: str | None = None,
    gpus: int | None = None,
) -> Placement:
    """Every rank's device, or a :class:`WorkloadError` saying how many GPUs are missing.

    ``colocated`` (None: the default) picks the baseline: dp on the CPU; on CUDA dp-ep,
    one rank per GPU in use, or mono where that is one GPU (module docstring). ``gpus``:
    the GPUs visible (default: as many as torch sees)."""
    if colocated is not None and colocated not in COLOCATED:
        raise WorkloadError(f"--colocated {colocated}: choose one of {', '.join(COLOCATED)}")
    if kind == "cpu":
        mode = colocated or "dp"
        return Placement(
            "cpu",
            ("cpu",) * attention,
            ("cpu",) * ffn,
            _colocated_devices(mode, ("cpu",) * attention, ("cpu",) * (attention + ffn)),
            False,
            mode,
        )
    count = torch.cuda.device_count() if gpus is None else gpus
    needed = attention + ffn
    if needed > count and not share_gpus:
        raise WorkloadError(
            f"--device cuda runs one process per GPU: {attention} attention + {ffn} FFN ranks "
            f"need {needed} GPUs, but {count} are visible; use fewer ranks, or add --share-gpus "
            f"to place several ranks per GPU under CUDA MPS (then one GPU's timings include "
            f"the sharing, and rows cross HBM instead of NVLink)"
        )
    devices = [f"cuda:{i % count}" for i in range(needed)]
    in_use = tuple(devices[: min(needed, count)])  # one colocated rank per GPU
    mode = colocated or "dp-ep"
    if mode == "dp-ep" and len(in_use) == 1:
        mode = "mono"  # DP1+EP1 is the monolithic model
    return Placement(
        "cuda",
        tuple(devices[:attention]),
        tuple(devices[attention:]),
        _colocated_devices(mode, tuple(devices[:attention]), in_use),
        needed > count,
        mode,
    )


def _colocated_devices(
    mode: str, attention: tuple[str, ...], per_processor: tuple[str, ...]
) -> tuple[str, ...]:
    """The colocated ranks' devices for ``mode`` (see :attr:`Placement.colocated`)."""
    if mode == "mono":
        return attention[:1]
    if mode == "dp-ep":
        return per_processor
    return attention


def rank_device(connection: Connection, device: str) -> torch.device:
    """Where this rank's model runs: ``device`` ("cpu", "cuda:N"); a transport on a GPU
    must be on that same GPU (afd_models probes the GPU's GEMMs when a model is built on
    it: :func:`afd_models.check_gemms_write_every_output`)."""
    chosen = torch.device(device)
    there = connection.device
    if there.type != "cpu" and there != chosen:
        raise RuntimeError(
            f"the transport runs on {there} but this rank was given {chosen}; the launcher and "
            f"the transport must place ranks alike"
        )
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    return chosen


def random_weights(seed: int, device: torch.device) -> RandomWeights:
    """The run's weights, drawn where they are used: on a GPU (fast for large presets, and
    the same values on every GPU) or on the CPU."""
    return RandomWeights(seed, device=device if device.type == "cuda" else "cpu")
