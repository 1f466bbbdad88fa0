"""What a new prompt length costs in scaled_dot_product_attention, per backend, at
DeepSeek MLA's head dims (q/k 192, v 128, 128 heads, bf16) on one GPU.

Why: in ``afd run --device cuda`` whichever mode runs first in a launch measured 3-7x the
attention-side compute per layer of the same mode run later, although warm-ups at the
smallest and the largest batch had run. Each distinct prompt length is a new attention
shape; a backend that builds a plan per shape (cuDNN) pays on each first use, and a
second mode over the same workload finds every plan cached. This prints, per backend,
the first call and the repeat call of several fresh lengths.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as nnf
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "default": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "math": [SDPBackend.MATH],
}


def one(n: int, heads: int, backends: list[SDPBackend] | None) -> float:
    q = torch.randn(1, heads, n, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, heads, n, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if backends is None:
        nnf.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        with sdpa_kernel(backends):
            nnf.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--heads", type=int, default=128)
    args = p.parse_args()
    print(torch.__version__, torch.cuda.get_device_name())
    print("| backend | first call of a new length, ms (median, max) | same length again, ms |")
    print("| --- | --- | --- |")
    base = 997
    for name, backends in BACKENDS.items():
        firsts, again = [], []
        try:
            one(64 + base, args.heads, backends)  # the backend's own one-time set-up
            for i in range(6):
                n = 1000 + 317 * i + base  # lengths no other backend has seen
                firsts.append(one(n, args.heads, backends))
                again.append(one(n, args.heads, backends))
        except RuntimeError as exc:
            print(f"| {name} | unavailable: {str(exc).splitlines()[0][:80]} | |")
            continue
        finally:
            base += 7
        print(
            f"| {name} | {statistics.median(firsts):.2f} ({max(firsts):.2f}) | "
            f"{statistics.median(again):.2f} |"
        )


if __name__ == "__main__":
    main()
