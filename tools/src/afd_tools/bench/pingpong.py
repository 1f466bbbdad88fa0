"""The flag ping-pong both transport benchmarks time: notify, then wait for the echo."""

from __future__ import annotations

import time

from afd_protocol import Role
from afd_protocol.window import WindowTransport


def flag_pingpong(
    transport: WindowTransport, ring: int, first: int, iterations: int
) -> list[float]:
    """Bounce flag ``(rank, ring)`` between attention rank 0 and FFN rank 0.

    The attention side publishes ``first``, ``first + 1``, ... and times each round trip;
    the FFN side echoes what it saw. ``first - 1`` must be the value both sides last left
    in that ring's flags (0 for a fresh window). Returns the attention side's samples.
    """
    window = transport.window
    out_flag = window.flag_index(transport.rank, ring)
    in_flag = window.flag_index(0, ring)
    seen = first - 1
    samples = []
    for i in range(first, first + iterations):
        start = time.perf_counter()
        if transport.role is Role.ATTENTION:
            transport.publish(0, out_flag, i)
            (seen,) = transport.wait_any([in_flag], [seen], 30.0, [0]).values
            samples.append(time.perf_counter() - start)
        else:
            (seen,) = transport.wait_any([in_flag], [seen], 30.0, [0]).values
            transport.publish(0, out_flag, seen)
    return samples
