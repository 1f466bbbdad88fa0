"""AFD ranks sharing a GPU under CUDA MPS: each rank's share of the GPU's SMs, checked
before anything starts, and a private MPS daemon for the length of the launch.

NVSHMEM runs several processes on one GPU fully only when every one of them is a client
of one MPS server and their active-thread percentages on that GPU add up to at most 100
(:mod:`afd_transport_nvshmem.mps`). So when a GPU holds more than one AFD rank, ``afd run``

* gives every AFD rank a share (:func:`afd_shares`): by default an equal split of each GPU
  among its ranks; ``--mps-attention-share`` / ``--mps-ffn-share`` give each rank of that
  role that many percent, and the ranks of the other role on the same GPU split what is
  left equally;
* starts a private MPS daemon just before the launch (one already answering on
  ``CUDA_MPS_PIPE_DIRECTORY`` is used and left running), puts each rank's client
  environment into its :class:`~afd_protocol.launch.RankSpec`, and stops the daemon when
  the launch ends, fails or is interrupted (:func:`mps_clients`). The GPU's compute mode
  is never read or changed.

``--no-mps`` shares the GPUs without MPS (the shared-memory transport works; NVSHMEM
refuses). The colocated baselines never share a GPU (:mod:`afd_tools.run.devices`), so
they run outside MPS, each rank on a whole GPU.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType

from afd_protocol import DeviceSharing, get_transport
from afd_protocol.launch import sigterm_as_interrupt
from afd_tools.prefill.workload import WorkloadError
from afd_tools.run.devices import Placement
from afd_transport_nvshmem.mps import MpsDaemon, MpsError, equal_shares

SHARE_OPTIONS = {"attention": "--mps-attention-share", "ffn": "--mps-ffn-share"}
"""The command-line option that sets each rank's share, by role."""


def check_mps_options(
    placement: Placement,
    attention_share: int | None,
    ffn_share: int | None,
    no_mps: bool,
    transport: str,
) -> None:
    """Refuse the MPS options where they mean nothing (no GPU shared), contradict each
    other or the ``transport``'s needs (its registry entry's device sharing), with a
    one-line :class:`WorkloadError` saying what to change."""
    given = [
        flag
        for flag, used in (
            (SHARE_OPTIONS["attention"], attention_share is not None),
            (SHARE_OPTIONS["ffn"], ffn_share is not None),
            ("--no-mps", no_mps),
        )
        if used
    ]
    if given and not placement.shared:
        where = "on the CPU" if placement.kind == "cpu" else "here every rank has its own GPU"
        raise WorkloadError(
            f"{given[0]} applies only to ranks sharing a GPU (--device cuda --share-gpus with "
            f"more ranks than GPUs), but {where}: drop {given[0]}"
        )
    if no_mps and len(given) > 1:
        raise WorkloadError(
            f"--no-mps runs the shared GPUs without CUDA MPS, so there is no share to set: drop "
            f"{given[0]} or --no-mps"
        )
    if no_mps and get_transport(transport).device_sharing is DeviceSharing.MPS:
        raise WorkloadError(
            f"--no-mps: the {transport} transport refuses ranks sharing a GPU outside CUDA MPS "
            "(its barriers and signal waits would abort); add --transport shm or drop --no-mps"
        )


def afd_shares(
    placement: Placement, attention_share: int | None, ffn_share: int | None
) -> dict[str, int]:
    """Each AFD rank's CUDA MPS share in percent, by rank name (``"attention rank 0"``,
    ``"ffn rank 1"``); empty where no GPU holds two AFD ranks. A :class:`WorkloadError`
    names the GPU, its ranks and the numbers when a share is out of 1..100 or a GPU's
    shares add up to more than 100."""
    if not placement.shared:
        return {}
    given = {"attention": attention_share, "ffn": ffn_share}
    for role, value in given.items():
        if value is not None and not 1 <= value <= 100:
            raise WorkloadError(
                f"{SHARE_OPTIONS[role]} {value}: a CUDA MPS share is 1 to 100 (percent of a "
                f"GPU's SMs); give a value in that range"
            )
    shares: dict[str, int] = {}
    for gpu, names in placement.gpu_ranks().items():
        shares.update(gpu_shares(gpu, names, given))
    return shares


def gpu_shares(gpu: str, names: Sequence[str], given: Mapping[str, int | None]) -> dict[str, int]:
    """The shares of the ranks ``names`` on ``gpu``: ``given[role]`` for each rank of a role
    given one, the rest of the GPU split equally among the others (see
    :func:`afd_shares`)."""
    shares = {n: v for n in names if (v := given[_role(n)]) is not None}
    options = sorted({SHARE_OPTIONS[_role(n)] for n in shares})
    free = [n for n in names if n not in shares]
    if free:
        left = 100 - sum(shares.values())
        each = equal_shares(len(free)) if not shares else left // len(free)
        if each < 1:
            raise WorkloadError(
                f"{gpu}: with {_listed(shares)}, {max(left, 0)} % of the GPU is left for "
                f"{_names(free)} (each needs at least 1 %); lower {' and '.join(options)}"
            )
        shares.update(dict.fromkeys(free, each))
    total = sum(shares.values())
    if total > 100:
        raise WorkloadError(
            f"{gpu} holds {_names(names)} with CUDA MPS shares "
            f"{' + '.join(str(shares[n]) for n in names)} = {total} %: the ranks of one GPU "
            f"may add up to at most 100 % (above it NVSHMEM's synchronising calls may "
            f"deadlock); lower {' or '.join(options)}"
        )
    return {n: shares[n] for n in names}


def describe_sharing(placement: Placement, shares: Mapping[str, int]) -> str:
    """How the AFD ranks share GPUs, for the report: ``""`` when they do not, else e.g.
    ``"GPUs shared under CUDA MPS: cuda:0 attention rank 0 50 %, ffn rank 0 50 %"``."""
    if not placement.shared:
        return ""
    if not shares:
        return "GPUs shared without CUDA MPS"
    per_gpu = [
        f"{gpu} " + ", ".join(f"{n} {shares[n]} %" for n in names)
        for gpu, names in placement.gpu_ranks().items()
    ]
    return "GPUs shared under CUDA MPS: " + "; ".join(per_gpu)


def start_daemon() -> MpsDaemon:
    """The MPS daemon of a launch: :meth:`MpsDaemon.start` with this process's environment
    (a daemon already answering on ``CUDA_MPS_PIPE_DIRECTORY`` is used, else a private
    one is started)."""
    return MpsDaemon.start()


@contextlib.contextmanager
def mps_clients(
    shares: Mapping[str, int], start: Callable[[], MpsDaemon] | None = None
) -> Iterator[dict[str, dict[str, str]]]:
    """Each rank's extra environment (rank name -> variables) as a client of one MPS daemon
    with its share; ``{}`` and no daemon when ``shares`` is empty.

    The daemon (``start()``, default :func:`start_daemon`) is stopped on leaving
    the block however it is left; SIGTERM meanwhile raises KeyboardInterrupt (it unwinds
    like Ctrl-C), and a Ctrl-C or SIGTERM during the stop waits for the stop to finish. A
    daemon that cannot start is a one-line :class:`WorkloadError`."""
    if not shares:
        yield {}
        return
    with sigterm_as_interrupt():
        try:
            daemon = (start or start_daemon)()
        except MpsError as exc:
            raise WorkloadError(
                f"ranks share a GPU, which needs CUDA MPS: {exc} (or add --no-mps with "
                f"--transport shm)"
            ) from None
        try:
            yield {name: daemon.client_environment(share) for name, share in shares.items()}
        finally:
            close_undisturbed(daemon)


def close_undisturbed(daemon: MpsDaemon) -> None:
    """``daemon.close()`` with Ctrl-C and SIGTERM held back until it is done (main thread;
    elsewhere signals are not Python's to catch), then raised as KeyboardInterrupt: an
    impatient second Ctrl-C must not leave the daemon behind."""
    if threading.current_thread() is not threading.main_thread():
        daemon.close()
        return
    caught: list[int] = []

    def later(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in held}
    for s in held:
        signal.signal(s, later)
    try:
        daemon.close()
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
    if caught:
        raise KeyboardInterrupt(f"signal {signal.Signals(caught[0]).name}")


def _role(name: str) -> str:
    """``"attention rank 0"`` -> ``"attention"``."""
    return name.split()[0]


def _names(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _listed(shares: Mapping[str, int]) -> str:
    """``"ffn rank 0 at 90 % and ffn rank 1 at 20 %"``."""
    return _names([f"{n} at {v} %" for n, v in shares.items()])
