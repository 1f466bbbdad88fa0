"""How much attention work the materialised boolean mask cost a workload, on paper.

Before 65433b7 a prompt piece that starts after position 0 (a chunk continuing a prompt
longer than the step's budget, or the part of a prompt that a stage cut puts in a later
stage) attended with a materialised ``[len, start + len]`` boolean mask, and the GPU's
memory-efficient kernel computed every tile of that rectangle: ``len * (start + len)``
query-key pairs. Causal attention needs ``len * start + len**2 / 2`` of them, which is what
the lower-right causal bias (and ``is_causal`` for a piece at 0) computes, give or take a
tile. This replays a workload's steps per replica exactly as ``afd run`` schedules them
(:class:`~afd_tools.prefill.workload.ChunkQueue`, and the stage cut that ``afd sim``
shares with :meth:`afd_models.batch.PromptBatch.stages`) and prints, per replica count
and stage count, the ratio of the two: how much more work the boolean mask made the
attention kernel do. Paper only: it counts pairs, not time (the kernel is part of a
layer's attention compute).

    python3 tools/dev/mask_work.py --replicas 1,2,3 --stages 1,2,4
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from afd_tools.prefill.workload import ChunkQueue, Request, arrival_times, assign, prompt_lengths
from afd_tools.sim.modes import stage_pieces


def piece_work(start: int, length: int) -> tuple[float, float]:
    """``(boolean mask, causal)`` query-key pairs of ``length`` queries at positions
    ``start..`` over keys ``0..start+length``; a piece at 0 is causal in both forms."""
    causal = length * start + length * length / 2
    return (causal if start == 0 else float(length * (start + length))), causal


def replica_work(requests: Sequence[Request], budget: int, stages: int) -> tuple[float, float]:
    """``(boolean mask, causal)`` pairs over every step of one replica's ``requests`` (all at
    once), each step cut into ``stages`` stages as ``afd run`` cuts it
    (:func:`afd_tools.sim.modes.stage_pieces`)."""
    queue = ChunkQueue(requests, budget)
    masked = causal = 0.0
    while not queue.empty:
        for pieces in stage_pieces(queue.next_step(math.inf), stages):
            for begin, end in pieces:
                m, c = piece_work(begin, end - begin)
                masked += m
                causal += c
    return masked, causal


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="uneven", help="afd run's --workload (default uneven)")
    p.add_argument("--requests", type=int, default=48, help="requests (default 48)")
    p.add_argument("--max-prompt-len", type=int, default=16384, help="(default 16384)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="(default 16384)")
    p.add_argument("--seed", type=int, default=0, help="afd run's --seed (default 0)")
    p.add_argument("--replicas", default="1,2,3", help="attention replicas, comma-separated")
    p.add_argument("--stages", default="1,2,4", help="stage counts, comma-separated")
    args = p.parse_args(argv)
    lengths = prompt_lengths(args.workload, args.requests, args.seed, args.max_prompt_len)
    arrivals = arrival_times(len(lengths), None, args.seed)
    print("| replicas | stages | boolean mask / causal pairs | per replica |")
    print("| --- | --- | --- | --- |")
    for replicas in (int(x) for x in args.replicas.split(",")):
        requests = assign(lengths, arrivals, replicas, "round-robin")
        for stages in (int(x) for x in args.stages.split(",")):
            works = [
                replica_work(
                    [r for r in requests if r.replica == k], args.max_num_batched_tokens, stages
                )
                for k in range(replicas)
            ]
            whole = sum(m for m, _ in works) / sum(c for _, c in works)
            each = ", ".join(f"{m / c:.3f}" for m, c in works)
            print(f"| {replicas} | {stages} | {whole:.3f} | {each} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
