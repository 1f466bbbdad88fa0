"""What a prompt's attention costs when async AFD cuts it into stage pieces, per mask form,
at DeepSeek MLA's head dims (q/k 192, v 128; v2-lite's 16 heads, V3's 128) in bf16 on one
GPU, with the kernels the model allows (``afd_models.attention.CUDA_SDPA_BACKENDS``: the
memory-efficient kernel, flash needs equal q/v head dims).

Why: on one H100 a layer's attention cost 7-28 % more at two stages than at one
(docs/sim.md). A later piece ``[b, n)`` of a prompt attends to keys ``[0, n)``; given as a
materialised boolean mask, the kernel reads a ``[n - b, n]`` bias and computes every tile,
the masked ones too; given as ``causal_lower_right`` it applies the mask itself and skips
the tiles it masks whole, so the pieces together cost what the whole prompt does. This
prints, per prompt length and stage count, the whole prompt's time, the pieces' with each
mask form, and how far the two forms' outputs differ (relative to the output's largest
magnitude; any NaN or inf fails the run).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as nnf
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The model's allowed kernels (afd_models.attention.CUDA_SDPA_BACKENDS, kept in step by
hand: this script imports nothing of afd)."""
QK_DIM, V_DIM = 192, 128


def boolean_mask(start: int, length: int, device: torch.device) -> torch.Tensor:
    """The mask the model built before: ``[length, start + length]`` bool, True where query
    ``start + i`` may attend key ``j`` (``j <= start + i``)."""
    qpos = torch.arange(start, start + length, device=device)
    kpos = torch.arange(start + length, device=device)
    return kpos[None, :] <= qpos[:, None]


def pieces(n: int, stages: int) -> list[tuple[int, int]]:
    """Near-equal ``(begin, end)`` token ranges of a prompt of ``n`` tokens, as a batch of
    one prompt is cut into ``stages`` stages."""
    bounds = [(i * n) // stages for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: list[tuple[int, int]], form: str
) -> torch.Tensor:
    """The prompt's attention output ``[1, heads, n, V_DIM]`` computed piece by piece (each
    piece's queries over the keys up to its end) with mask ``form`` ("bool" or "lower-right")
    for the pieces that start after 0. ``q``: ``[1, heads, n, QK_DIM]``, ``k``: the same,
    ``v``: ``[1, heads, n, V_DIM]``, bf16 on the GPU."""
    outs = []
    for begin, end in ranges:
        qs, ks, vs = q[:, :, begin:end], k[:, :, :end], v[:, :, :end]
        if begin == 0:
            outs.append(nnf.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
            continue
        mask = (
            boolean_mask(begin, end - begin, q.device)
            if form == "bool"
            else causal_lower_right(end - begin, end)
        )
        outs.append(nnf.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask))
    return torch.cat(outs, dim=2)


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[list[float], torch.Tensor]:
    """``fn``'s wall times in ms over ``repeats`` calls after one warm call, and its output."""
    out = fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times, out


def spread(times: list[float]) -> str:
    """Median (min-max) of ``times``."""
    return f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", type=int, action="append", help="heads (default: 16 and 128)")
    p.add_argument("--lengths", default="4096,8192,16384", help="prompt lengths, comma-separated")
    p.add_argument("--stages", default="2,4", help="stage counts, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per cell (default 5)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("stage_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    heads_list = args.heads or [16, 128]
    lengths = [int(x) for x in args.lengths.split(",")]
    stage_counts = [int(x) for x in args.stages.split(",")]
    print(torch.__version__, torch.cuda.get_device_name())
    print(
        "| heads | tokens | stages | whole prompt ms | pieces, bool mask ms | pieces, "
        "lower-right ms | bool / whole | lower-right / whole | max diff / largest output |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    for heads in heads_list:
        for n in lengths:
            shape = (1, heads, n)
            q = torch.randn(*shape, QK_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            k = torch.randn(*shape, QK_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(*shape, V_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            with sdpa_kernel(BACKENDS):
                run = functools.partial(attend, q, k, v)
                whole_t, whole = timed(functools.partial(run, [(0, n)], "bool"), args.repeats)
                for stages in stage_counts:
                    ranges = pieces(n, stages)
                    bool_t, old = timed(functools.partial(run, ranges, "bool"), args.repeats)
                    right_t, new = timed(
                        functools.partial(run, ranges, "lower-right"), args.repeats
                    )
                    scale = float(whole.float().abs().max())
                    diff = float((new.float() - old.float()).abs().max()) / scale
                    to_whole = float((new.float() - whole.float()).abs().max()) / scale
                    finite = all(bool(torch.isfinite(t).all()) for t in (whole, old, new))
                    if not (finite and math.isfinite(diff) and diff < 2e-2 and to_whole < 2e-2):
                        failed = True
                    w = statistics.median(whole_t)
                    print(
                        f"| {heads} | {n} | {stages} | {spread(whole_t)} | {spread(bool_t)} | "
                        f"{spread(right_t)} | {statistics.median(bool_t) / w:.2f}x | "
                        f"{statistics.median(right_t) / w:.2f}x | {diff:.1e} "
                        f"(to whole {to_whole:.1e}){'' if finite else ' NOT FINITE'} |"
                    )
            torch.cuda.empty_cache()
    if failed:
        print("stage_attention: FAIL: outputs not finite or apart by 2e-2 or more")
        return 1
    print("stage_attention: PASS: both mask forms agree with each other and the whole prompt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
