"""Prefill workloads: prompt lengths, arrival times, and which replica gets each request.

Presets model the mixes that matter for AFD: ``uniform`` (every replica does about the
same attention work), ``uneven`` (heavy-tailed: a few long prompts dominate the attention
cost, which grows with the sum of squared lengths), and ``bimodal`` (short chat turns and
long documents). Lengths can also come from a JSONL file (one ``{"prompt_len": N}`` or
``{"prompt_tokens": [...]}`` object per line).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PRESETS = ("uniform", "uneven", "bimodal")
ASSIGNMENTS = ("round-robin", "least-tokens")


class WorkloadError(ValueError):
    """A workload option or file is invalid; the message says what to change."""


@dataclass(frozen=True)
class Request:
    """One prefill request."""

    request_id: int
    prompt_len: int
    arrival: float
    """Seconds after the start of the run at which the request arrives."""
    replica: int = -1


def prompt_lengths(preset: str, count: int, seed: int, max_len: int, min_len: int = 4) -> list[int]:
    """``count`` prompt lengths in ``[min_len, max_len]`` drawn from a named preset."""
    if preset not in PRESETS:
        raise WorkloadError(f"unknown workload {preset!r}; choose one of {list(PRESETS)}")
    if count < 1:
        raise WorkloadError(f"--requests must be >= 1, got {count}")
    if max_len < min_len:
        raise WorkloadError(f"the longest prompt ({max_len}) is shorter than {min_len} tokens")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if preset == "uniform":
            value = rng.uniform(0.4, 0.6) * max_len
        elif preset == "uneven":
            # Heavy tail: most prompts short, about one in six over half the maximum.
            value = max_len * rng.random() ** 4
        else:
            value = (
                rng.uniform(0.02, 0.08) * max_len
                if rng.random() < 0.75
                else (rng.uniform(0.7, 1.0) * max_len)
            )
        out.append(max(min_len, min(max_len, int(value))))
    return out


def read_lengths(path: Path, max_len: int) -> list[int]:
    """Prompt lengths from a JSONL file; over-long prompts are an error, not truncated."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read the workload file {path}: {exc}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            length = (
                int(record["prompt_len"])
                if "prompt_len" in record
                else len(record["prompt_tokens"])
            )
        except (ValueError, KeyError, TypeError):
            raise WorkloadError(
                f"{path}:{number}: expected a JSON object with prompt_len (an integer) or "
                f"prompt_tokens (a list)"
            ) from None
        if not 1 <= length <= max_len:
            raise WorkloadError(
                f"{path}:{number}: prompt of {length} tokens is outside [1, {max_len}] "
                f"(raise --max-num-batched-tokens or shorten the prompt)"
            )
        out.append(length)
    if not out:
        raise WorkloadError(f"{path} holds no requests")
    return out


def arrival_times(count: int, rate: float | None, seed: int) -> list[float]:
    """All at once (``rate`` None) or a Poisson process at ``rate`` requests per second."""
    if rate is None:
        return [0.0] * count
    if not (math.isfinite(rate) and rate > 0):
        raise WorkloadError(f"--rate must be a positive number of requests per second, got {rate}")
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def assign(
    lengths: Sequence[int], arrivals: Sequence[float], replicas: int, policy: str
) -> list[Request]:
    """Requests with replicas chosen by ``round-robin`` or ``least-tokens`` (outstanding)."""
    if policy not in ASSIGNMENTS:
        raise WorkloadError(f"unknown assignment {policy!r}; choose one of {list(ASSIGNMENTS)}")
    load = [0] * replicas
    out = []
    order = sorted(range(len(lengths)), key=lambda i: (arrivals[i], i))
    for position, i in enumerate(order):
        if policy == "round-robin":
            replica = position % replicas
        else:
            replica = min(range(replicas), key=lambda r: (load[r], r))
        load[replica] += lengths[i]
        out.append(Request(i, lengths[i], arrivals[i], replica))
    return sorted(out, key=lambda r: r.request_id)


def batches(requests: Sequence[Request], max_tokens: int) -> list[list[Request]]:
    """First come, first served batches of at most ``max_tokens`` prompt tokens each."""
    out: list[list[Request]] = []
    current: list[Request] = []
    used = 0
    for request in sorted(requests, key=lambda r: (r.arrival, r.request_id)):
        if request.prompt_len > max_tokens:
            raise WorkloadError(
                f"request {request.request_id} has {request.prompt_len} prompt tokens, more "
                f"than --max-num-batched-tokens {max_tokens}"
            )
        if current and used + request.prompt_len > max_tokens:
            out.append(current)
            current, used = [], 0
        current.append(request)
        used += request.prompt_len
    if current:
        out.append(current)
    return out
