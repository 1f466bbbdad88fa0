"""Command-line options that ``afd run`` and ``afd sim`` share, defined once so that a
simulated deployment is described exactly like a measured one: the workload (presets,
JSONL files, arrivals, assignment, batching budget) and the wire (stages, shared-expert
placement, wire format, who reduces)."""

from __future__ import annotations

import argparse
from pathlib import Path

from afd_protocol import CombineReduce, SharedPlacement, WireFormat
from afd_tools.prefill.workload import ASSIGNMENTS, PRESETS


def add_workload_options(p: argparse.ArgumentParser) -> None:
    """``--workload``, ``--workload-file``, ``--requests``, ``--max-prompt-len``, ``--rate``,
    ``--assign``, ``--max-num-batched-tokens``."""
    p.add_argument("--workload", choices=PRESETS, default="uneven", help="prompt-length mix")
    p.add_argument(
        "--workload-file",
        type=Path,
        default=None,
        help="JSONL with prompt_len (a whole number) or prompt_tokens (token ids) per line "
        "(overrides --workload)",
    )
    p.add_argument("--requests", type=int, default=48, help="number of requests")
    p.add_argument(
        "--max-prompt-len",
        type=int,
        default=256,
        help="longest prompt of a --workload preset; any length up to the model's "
        "max_position_embeddings works with any --max-num-batched-tokens (long prompts are "
        "prefilled in chunks)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests/s (default: all at once)",
    )
    p.add_argument(
        "--assign",
        choices=ASSIGNMENTS,
        default="round-robin",
        help="how requests are given to replicas, in arrival order: round-robin, or "
        "least-tokens, to the replica given the fewest prompt tokens so far (all at once "
        "the least loaded; under --rate a static balance that does not see completions), or "
        "pull: none before the run; one shared first-come-first-served queue, from which "
        "each replica claims arrived requests at the start of each step while its queued "
        "tokens are fewer than --max-num-batched-tokens (it takes work when its next step "
        "has room; needs no prior knowledge of completion times; costs one shared counter "
        "with a lock per mode)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="tokens per prefill step and replica (also the slot capacity); longer prompts "
        "are prefilled in chunks over several steps",
    )


def add_wire_options(p: argparse.ArgumentParser) -> None:
    """``--stages``, ``--shared``, ``--wire-format``, ``--combine-reduce``."""
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        help="async mode: token-level stages per step (the attention of stage i+1 overlaps "
        "the FFN work of stage i)",
    )
    p.add_argument(
        "--min-stage-tokens",
        type=int,
        default=0,
        metavar="N",
        help="async mode: cut a step into fewer stages where it has under N tokens per "
        "stage (a stage's fixed costs do not shrink with its tokens: on one H200 a 512-token "
        "stage of v2-lite's attention took 3.3 ms per MoE layer, the whole 1,024-token step "
        "3.0); 0 (default): always --stages",
    )
    p.add_argument(
        "--shared",
        choices=[s.value for s in SharedPlacement],
        default="attention",
        help="where shared experts run (attention: overlapped with the routed work, no bytes "
        "on the wire; ffn: split round-robin over the FFN ranks)",
    )
    p.add_argument(
        "--wire-format",
        choices=[w.value for w in WireFormat],
        default="per_rank",
        help="per_rank: a token's row travels once per FFN rank holding any of its experts; "
        "per_choice: once per (token, expert)",
    )
    p.add_argument(
        "--combine-reduce",
        choices=[c.value for c in CombineReduce],
        default="ffn",
        help="who weights and sums a token's partials: the FFN ranks (per_rank only, one "
        "reply row per token) or the attention side",
    )
