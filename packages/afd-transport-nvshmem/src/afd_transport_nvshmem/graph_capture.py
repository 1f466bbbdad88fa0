"""How the graph-replayed endpoints make a CUDA graph, and its stand-in on the CPU.

:data:`GraphCapture` is the one seam: ``capture(body) -> (replay, outputs)``.
:class:`CudaGraphCapture` records ``body`` as a CUDA graph on a GPU; tests on the CPU pass
:func:`replayed_calls`, which re-runs the captured calls with the arguments of capture time
-- what a graph does -- so a value the host forgot to route through memory shows up stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from afd_protocol import keeping_constants

_T = TypeVar("_T")

Replay = Callable[[], None]
GraphCapture = Callable[[Callable[[], Any]], tuple[Replay, Any]]
"""``capture(body) -> (replay, outputs)``: record ``body``'s device work once; every
``replay()`` redoes it with the same arguments and leaves its results in ``outputs`` (the
tensors ``body`` returned at capture)."""


class CudaGraphCapture:
    """:data:`GraphCapture` with ``torch.cuda.CUDAGraph`` on a side stream of ``device``
    (``thread_local`` capture, each graph its own memory pool; replays on the current
    stream). No device synchronisation and no garbage collection per capture.
    ``keep_graphs``: every graph keeps its ``cudaGraph_t`` and is listed in
    :attr:`graphs`, so its nodes can be read (:mod:`~afd_transport_nvshmem.graph_census`)."""

    def __init__(self, device: torch.device, keep_graphs: bool = False) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._keep = keep_graphs
        self.graphs: list[torch.cuda.CUDAGraph] = []
        """With ``keep_graphs``: every graph captured, in order."""

    def __call__(self, body: Callable[[], _T]) -> tuple[Replay, _T]:
        graph = torch.cuda.CUDAGraph(keep_graph=self._keep)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream), keeping_constants() as kept:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = body()
            except BaseException:
                # The capture is invalid already; the body's error says why.
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()
                raise
            graph.capture_end()
        if self._keep:
            graph.instantiate()
            self.graphs.append(graph)
        return _CapturedGraph(graph, kept).replay, outputs


class _CapturedGraph:
    """A graph and the constant tables it was captured with: the graph holds their
    addresses, this object the references (``constant_index``'s cache may drop them)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, constants: list[torch.Tensor]) -> None:
        self._graph = graph
        self._constants = constants

    def replay(self) -> None:
        self._graph.replay()


def replayed_calls(body: Callable[[], _T]) -> tuple[Replay, _T]:
    """:data:`GraphCapture` without a GPU, for tests: runs ``body`` now, and on each replay
    runs it again -- with the Python values of capture time, as a graph would -- and copies
    the tensors it returns into those returned now."""
    outputs = body()

    def replay() -> None:
        for kept, fresh in zip(_tensors(outputs), _tensors(body()), strict=True):
            kept.copy_(fresh)

    return replay, outputs


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``: a tensor, a tuple or list, or a dataclass's fields."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for spec in dataclasses.fields(value):
            yield from _tensors(getattr(value, spec.name))
