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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

PRESETS = ("uniform", "uneven", "bimodal")
ASSIGNMENTS = ("round-robin", "least-tokens", "pull")
PULL = "pull"
"""The completion-aware policy: no replica is chosen before the run; every replica claims
arrived requests from one shared pool at the start of each of its steps
(:meth:`ChunkQueue.refill`)."""
UNASSIGNED = -1
"""``Request.replica`` of a request no replica was given before the run (``pull``)."""


class WorkloadError(ValueError):
    """A workload option or file is invalid; the message says what to change."""


@dataclass(frozen=True)
class Request:
    """One prefill request."""

    request_id: int
    prompt_len: int
    arrival: float
    """Seconds after the start of the run at which the request arrives."""
    replica: int = UNASSIGNED
    """The replica given the request before the run; :data:`UNASSIGNED` under ``pull``,
    where the replica that claims it while the run lasts serves it."""
    tokens: tuple[int, ...] | None = None
    """The prompt's token ids when the workload gave them (else drawn from the seed)."""


def prompt_lengths(preset: str, count: int, seed: int, max_len: int, min_len: int = 4) -> list[int]:
    """``count`` prompt lengths in ``[min(min_len, max_len), max_len]`` from a named preset."""
    if preset not in PRESETS:
        raise WorkloadError(f"unknown workload {preset!r}; choose one of {list(PRESETS)}")
    if count < 1:
        raise WorkloadError(f"--requests must be >= 1, got {count}")
    if max_len < 1:
        raise WorkloadError(f"--max-prompt-len must be >= 1, got {max_len}")
    min_len = min(min_len, max_len)
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


Prompt = tuple[int, tuple[int, ...] | None]
"""A workload entry: the prompt's length and, when the file gave them, its token ids."""


def read_workload(path: Path, max_len: int, vocab: int) -> list[Prompt]:
    """Prompts from a JSONL file (module docstring); raises :class:`WorkloadError` naming the
    file, line and field of the first bad entry. Nothing is truncated: a prompt longer than
    ``max_len`` (the model's maximum) is an error."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise WorkloadError(
            f"cannot read the workload file {path}: {exc.strerror or exc}"
        ) from None
    except UnicodeDecodeError as exc:
        where = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise WorkloadError(
            f"{path}:{where}: not UTF-8 text (byte {exc.start}); a workload is JSON lines"
        ) from None
    out: list[Prompt] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            out.append(_parse_line(f"{path}:{number}", line, max_len, vocab))
    if not out:
        raise WorkloadError(f"{path} holds no requests")
    return out


def _parse_line(where: str, line: str, max_len: int, vocab: int) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or ("prompt_len" in record) == ("prompt_tokens" in record):
        raise WorkloadError(
            f"{where}: expected an object with exactly one of prompt_len (a whole number) or "
            f"prompt_tokens (a list of token ids)"
        )
    if "prompt_len" in record:
        length = record["prompt_len"]
        if not _whole(length) or not 1 <= length <= max_len:
            raise WorkloadError(
                f"{where}: prompt_len must be a whole number in [1, {max_len}] (the model's "
                f"longest prompt), got {json.dumps(length)[:40]}"
            )
        return length, None
    tokens = record["prompt_tokens"]
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= max_len:
        got = f"{len(tokens)} tokens" if isinstance(tokens, list) else type(tokens).__name__
        raise WorkloadError(
            f"{where}: prompt_tokens must be a list of 1 to {max_len} token ids, got {got}"
        )
    bad = next((i for i, t in enumerate(tokens) if not (_whole(t) and 0 <= t < vocab)), None)
    if bad is not None:
        raise WorkloadError(
            f"{where}: prompt_tokens[{bad}] must be a token id in [0, {vocab}), got "
            f"{json.dumps(tokens[bad])[:40]}"
        )
    return len(tokens), tuple(tokens)


def _whole(value: object) -> bool:
    """A JSON integer (not a bool, not a float such as 3.0 or Infinity)."""
    return isinstance(value, int) and not isinstance(value, bool)


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
    lengths: Sequence[int],
    arrivals: Sequence[float],
    replicas: int,
    policy: str,
    tokens: Sequence[tuple[int, ...] | None] | None = None,
) -> list[Request]:
    """Requests with replicas chosen in arrival order by ``round-robin`` or ``least-tokens``
    (the replica given the fewest prompt tokens so far: all at once the least loaded; under
    arrivals a static balance, blind to completions); ``tokens[i]`` are request ``i``'s
    token ids when the workload gave them. Under ``pull`` every request is left
    :data:`UNASSIGNED`: the replicas claim them from a shared pool while they run
    (:class:`ArrivalPool`, :meth:`ChunkQueue.refill`)."""
    if policy not in ASSIGNMENTS:
        raise WorkloadError(f"unknown assignment {policy!r}; choose one of {list(ASSIGNMENTS)}")
    load = [0] * replicas
    out = []
    order = sorted(range(len(lengths)), key=lambda i: (arrivals[i], i))
    for position, i in enumerate(order):
        if policy == PULL:
            replica = UNASSIGNED
        elif policy == "round-robin":
            replica = position % replicas
        else:
            replica = min(range(replicas), key=lambda r: (load[r], r))
            load[replica] += lengths[i]
        given = tokens[i] if tokens is not None else None
        out.append(Request(i, lengths[i], arrivals[i], replica, given))
    return sorted(out, key=lambda r: r.request_id)


def arrival_order(requests: Sequence[Request]) -> list[Request]:
    """``requests`` in the order they arrive (ties by request id): the order replicas take
    them in, from their own queue or from a shared pool."""
    return sorted(requests, key=lambda r: (r.arrival, r.request_id))


class RequestPool(Protocol):
    """Requests not yet claimed by any replica, handed out first come, first served."""

    def claim(self, now: float) -> Request | None:
        """Remove and return the earliest request arrived by ``now`` (seconds after the
        start), or ``None`` when none has arrived or none is left."""
        ...

    @property
    def next_arrival(self) -> float:
        """When the earliest unclaimed request arrives (``math.inf``: none is left)."""
        ...

    @property
    def exhausted(self) -> bool:
        """Whether every request was claimed."""
        ...


class Cursor(Protocol):
    """The index of the next unclaimed request in an arrival-ordered list, as its claimants
    share it (:class:`LocalCursor` in one process; ``afd run`` shares one across its
    replica processes: :class:`afd_tools.run.pull.SharedCursor`)."""

    def take(self, ready: Callable[[int], bool]) -> int | None:
        """Atomically: the current index if ``ready(index)``, the cursor moved past it;
        else ``None`` and the cursor unmoved."""
        ...

    def peek(self) -> int:
        """The current index (it may move as soon as it is read)."""
        ...


class LocalCursor:
    """A :class:`Cursor` of one process (the simulator's, the tests')."""

    def __init__(self) -> None:
        self.index = 0

    def take(self, ready: Callable[[int], bool]) -> int | None:
        if not ready(self.index):
            return None
        self.index += 1
        return self.index - 1

    def peek(self) -> int:
        return self.index


class ArrivalPool:
    """A :class:`RequestPool` over ``requests`` in arrival order, whose claims advance
    ``cursor`` (default: a :class:`LocalCursor`; replicas in other processes share one)."""

    def __init__(self, requests: Sequence[Request], cursor: Cursor | None = None) -> None:
        self.requests = tuple(arrival_order(requests))
        self.cursor: Cursor = cursor if cursor is not None else LocalCursor()

    def claim(self, now: float) -> Request | None:
        ordered = self.requests
        index = self.cursor.take(lambda i: i < len(ordered) and ordered[i].arrival <= now)
        return None if index is None else ordered[index]

    @property
    def next_arrival(self) -> float:
        index = self.cursor.peek()
        return self.requests[index].arrival if index < len(self.requests) else math.inf

    @property
    def exhausted(self) -> bool:
        return self.cursor.peek() >= len(self.requests)


@dataclass(frozen=True)
class Chunk:
    """Tokens ``begin .. end`` of request ``request_id``'s prompt; ``final`` ends it."""

    request_id: int
    begin: int
    end: int
    final: bool


@dataclass
class _Progress:
    request: Request
    done: int = 0
    """Prompt tokens already scheduled."""


class ChunkQueue:
    """First come, first served prefill steps of at most ``budget`` tokens, with chunking.

    Each step takes the arrived requests in arrival order; a prompt that does not fit in
    what is left of the budget contributes a chunk and stays at the head of the queue, so
    its next chunk goes first in the next step (the way vLLM's chunked prefill schedules
    long prompts). No prompt is ever too long for the budget.

    With a ``pool`` (``--assign pull``) the queue also takes requests from it at each step
    start (:meth:`refill`); it is :attr:`done` once it is empty and the pool exhausted.
    """

    def __init__(
        self, requests: Sequence[Request], budget: int, pool: RequestPool | None = None
    ) -> None:
        if budget < 1:
            raise WorkloadError(f"--max-num-batched-tokens must be >= 1, got {budget}")
        self.budget = budget
        self.pool = pool
        self._pending = [_Progress(request) for request in arrival_order(requests)]
        self._unscheduled = sum(r.prompt_len for r in requests)

    @property
    def empty(self) -> bool:
        """Nothing queued here (a pool may still hold requests: :attr:`done`)."""
        return not self._pending

    @property
    def done(self) -> bool:
        """Nothing queued here and nothing left to claim."""
        return not self._pending and (self.pool is None or self.pool.exhausted)

    @property
    def unscheduled(self) -> int:
        """Prompt tokens queued here and not yet in a step."""
        return self._unscheduled

    def add(self, request: Request) -> None:
        """Queue ``request`` after the others (a claimed request: it has arrived, and no
        earlier-arriving request is left to claim)."""
        self._pending.append(_Progress(request))
        self._unscheduled += request.prompt_len

    def refill(self, now: float) -> list[Request]:
        """The pull rule, at the start of a step: claim arrived requests from the pool, in
        arrival order, while the tokens queued here and not yet scheduled are fewer than
        the budget (so the next step has room for them); the requests claimed (none
        without a pool)."""
        claimed: list[Request] = []
        while self.pool is not None and self._unscheduled < self.budget:
            request = self.pool.claim(now)
            if request is None:
                break
            self.add(request)
            claimed.append(request)
        return claimed

    @property
    def next_arrival(self) -> float:
        """When the head of the queue, or of the pool, arrives (seconds after the start)."""
        head = self._pending[0].request.arrival if self._pending else math.inf
        return head if self.pool is None else min(head, self.pool.next_arrival)

    def next_step(self, now: float) -> list[Chunk]:
        """The chunks of the next step among the requests arrived by ``now`` (may be empty)."""
        chunks, used = [], 0
        for entry in self._pending:
            request = entry.request
            if request.arrival > now or used == self.budget:
                break
            take = min(request.prompt_len - entry.done, self.budget - used)
            end = entry.done + take
            chunks.append(Chunk(request.request_id, entry.done, end, end == request.prompt_len))
            entry.done = end
            used += take
        self._unscheduled -= used
        self._pending = [e for e in self._pending if e.done < e.request.prompt_len]
        return chunks
