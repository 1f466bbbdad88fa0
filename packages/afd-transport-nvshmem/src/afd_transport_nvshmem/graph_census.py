"""The nodes of a captured CUDA graph, read back from the graph itself (``cuGraphGetNodes``).

What a graph holds decides what its launch costs the host: kernel nodes next to nothing,
a memcpy node touching page-locked host memory about 5 µs each on one H200
(``tools/gpu/graph_launch.py``). The graphed endpoints keep host memory out of their
graphs' memcpy nodes; the GPU tests check it with :func:`graph_nodes`, and the tool prints
the census. Needs ``cuda-bindings`` and a graph kept after instantiation
(``torch.cuda.CUDAGraph(keep_graph=True)``; :class:`~.graphed_attention.CudaGraphCapture`
with ``keep_graphs=True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from afd_transport_nvshmem.cuda_memory import check_result


@dataclass(frozen=True)
class GraphNode:
    """One node: its ``kind`` (``"kernel"``, ``"memcpy"``, ``"memset"``, ``"host"``,
    ``"event_record"``, ...) and, for a kernel its function's name, for a memcpy
    ``"<source memory> -> <destination memory>, <bytes> B"`` (memory: ``host``,
    ``device``, ``array`` or ``unified``)."""

    kind: str
    detail: str = ""

    @property
    def touches_host(self) -> bool:
        """A memcpy from or to host memory (``host``, or ``unified``: the driver resolves
        the address, and page-locked host memory is one)."""
        return self.kind == "memcpy" and any(m in self.detail for m in ("host", "unified"))


def _name(value: Any, prefix: str) -> str:
    """``CU_GRAPH_NODE_TYPE_KERNEL`` -> ``kernel`` (an enum member's name, lower case)."""
    name = getattr(value, "name", str(value))
    return name.removeprefix(prefix).lower()


def graph_nodes(raw_graph: int) -> list[GraphNode]:
    """Every node of the ``cudaGraph_t`` at ``raw_graph`` (what
    ``torch.cuda.CUDAGraph.raw_cuda_graph()`` returns), in the graph's order."""
    from cuda.bindings import driver as cu

    graph = cu.CUgraph(raw_graph)
    err, _, count = cu.cuGraphGetNodes(graph, 0)
    check_result(err, "cuGraphGetNodes")
    err, nodes, count = cu.cuGraphGetNodes(graph, count)
    check_result(err, "cuGraphGetNodes")
    found = []
    for node in nodes[:count]:
        err, kind = cu.cuGraphNodeGetType(node)
        check_result(err, "cuGraphNodeGetType")
        name = _name(kind, "CU_GRAPH_NODE_TYPE_")
        detail = ""
        if name == "kernel":
            err, params = cu.cuGraphKernelNodeGetParams(node)
            name_of = getattr(cu, "cuFuncGetName", None)  # CUDA >= 12.3
            if int(err) == 0 and name_of is not None:
                got = name_of(params.func)
                if int(got[0]) == 0:
                    raw = got[1]
                    detail = raw.decode() if isinstance(raw, bytes) else str(raw)
        elif name == "memcpy":
            err, copy = cu.cuGraphMemcpyNodeGetParams(node)
            check_result(err, "cuGraphMemcpyNodeGetParams")
            source = _name(copy.srcMemoryType, "CU_MEMORYTYPE_")
            destination = _name(copy.dstMemoryType, "CU_MEMORYTYPE_")
            detail = f"{source} -> {destination}, {copy.WidthInBytes} B"
        found.append(GraphNode(name, detail))
    return found
