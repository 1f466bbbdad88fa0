"""``afd roundtrip``: one MoE layer's dispatch and combine through the wire format.

Every attention rank routes random tokens, plans its dispatch, and encodes each
destination's header; every FFN rank decodes and validates that header exactly as a
receiver would, computes linear experts from the group list alone (it never routes),
and encodes a reply header that the attention side validates against the dispatch it
answers. The combined output is compared with an independent per-token reference.
All in one process: the transport that moves these bytes between processes is the
next layer up.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from afd_protocol import (
    Header,
    MessageKind,
    ProtocolError,
    SharedPlacement,
    SlotLayout,
    Topology,
    combine,
    decode_header,
    encode_header,
    expert_ids_from_counts,
    plan_dispatch,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "roundtrip",
        help="dispatch and combine one MoE layer through the wire format and check it",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--attention-ranks", type=int, default=2, help="attention ranks (A)")
    p.add_argument("--ffn-ranks", type=int, default=2, help="FFN ranks (F)")
    p.add_argument("--experts", type=int, default=64, help="routed experts")
    p.add_argument("--topk", type=int, default=6, help="experts per token")
    p.add_argument("--tokens", type=int, default=512, help="max tokens per attention rank")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument(
        "--shared",
        choices=[s.value for s in SharedPlacement],
        default="attention",
        help="where shared experts run",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="activations")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    topo = Topology(args.attention_ranks, args.ffn_ranks, args.experts)
    layout = SlotLayout(
        topo, args.hidden, args.tokens, args.topk, dtype=args.dtype, shared_placement=args.shared
    )
    window = layout.window(ring_depth=1)
    scale = args.hidden**-0.5
    expert_w = torch.randn(args.experts, args.hidden, args.hidden, generator=gen) * scale
    shared_w = torch.randn(args.hidden, args.hidden, generator=gen) * scale

    print(
        f"afd roundtrip: {args.attention_ranks} attention x {args.ffn_ranks} FFN ranks, "
        f"{args.experts} experts top-{args.topk}, hidden {args.hidden} {args.dtype}, "
        f"shared experts on {args.shared}"
    )
    print(
        f"  window {window.total_bytes / 2**20:.1f} MiB per rank, slot {layout.slot_bytes} B, "
        f"routed_cap {layout.routed_cap}, digest {window.digest()}"
    )

    worst = 0.0
    checked_rows = 0
    seq = 0
    for rank in range(args.attention_ranks):
        # Uneven batch sizes per rank, as real replicas have.
        num_tokens = max(1, args.tokens * (rank + 1) // args.attention_ranks)
        x = torch.randn(num_tokens, args.hidden, generator=gen).to(dtype)
        logits = torch.randn(num_tokens, args.experts, generator=gen)
        weights, ids = torch.softmax(logits, dim=-1).topk(args.topk, dim=-1)
        plan = plan_dispatch(ids, topo, shared_placement=args.shared, layout=layout)

        replies = {}
        for dest in plan.destinations:
            seq += 1
            counts = plan.host_group_list(dest)
            sent = Header(
                MessageKind.DISPATCH,
                rank,
                0,
                0,
                num_tokens,
                plan.routed_rows(dest),
                plan.shared_rows(dest),
                seq=seq,
                expert_counts=counts,
            )
            # FFN side: everything it knows comes from the validated header.
            got = decode_header(
                encode_header(sent), layout.header_limits(MessageKind.DISPATCH, dest)
            )
            group_list = torch.tensor(got.expert_counts)
            local = expert_ids_from_counts(group_list, got.routed_rows)
            experts = torch.tensor(topo.local_experts(dest))[local]
            rows = plan.gather(x, dest).float()
            routed = torch.bmm(rows.unsqueeze(1), expert_w[experts]).squeeze(1).to(dtype)
            shared = None
            if got.shared_rows:
                shared = (plan.gather_shared(x, dest).float() @ shared_w).to(dtype)
            reply = Header(
                MessageKind.REPLY,
                dest,
                got.layer,
                got.stage,
                got.num_tokens,
                got.routed_rows,
                got.shared_rows,
                seq=got.seq,
                answer_seq=got.seq,
                expert_counts=got.expert_counts,
            )
            back = decode_header(
                encode_header(reply), layout.header_limits(MessageKind.REPLY, dest)
            )
            if back.answer_seq != sent.seq or back.expert_counts != sent.expert_counts:
                raise ProtocolError(f"reply from FFN rank {dest} does not answer seq {sent.seq}")
            replies[dest] = (routed, shared)
            checked_rows += got.routed_rows

        out = combine(plan, replies, weights, args.hidden, dtype)
        reference = torch.zeros(num_tokens, args.hidden, dtype=torch.float64)
        xd = x.double()
        for t in range(num_tokens):
            for j in range(args.topk):
                reference[t] += float(weights[t, j]) * (xd[t] @ expert_w[int(ids[t, j])].double())
            if args.shared == "ffn":
                reference[t] += xd[t] @ shared_w.double()
        err = float((out.double() - reference).norm() / reference.norm().clamp_min(1e-30))
        worst = max(worst, err)
        print(
            f"  attention rank {rank}: {num_tokens:5d} tokens -> FFN ranks "
            f"{list(plan.destinations)}, {plan.num_tokens * args.topk} partials routed once, "
            f"relative error {err:.2e}"
        )

    ok = worst <= TOLERANCE[args.dtype]
    print(
        f"  {checked_rows} routed rows through {seq} validated dispatch/reply header pairs; "
        f"worst relative error {worst:.2e} (tolerance {TOLERANCE[args.dtype]:.0e})"
    )
    print(
        f"{'PASS' if ok else 'FAIL'}: combined outputs "
        f"{'match' if ok else 'DO NOT match'} the per-token reference "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0 if ok else 1
