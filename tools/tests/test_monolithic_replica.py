"""The monolithic baseline's one rank (``--colocated mono``) in this process: it warms up as
an AFD replica does, so that its one mode is not the only cold one it is compared with."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch

from afd_models import MonolithicModel, PromptChunk, RandomWeights
from afd_models import preset as make_preset
from afd_protocol import Role, SlotLayout, Topology
from afd_tools.prefill.workload import Request
from afd_tools.run import monolithic
from afd_tools.run.monolithic import monolithic_connection, monolithic_replica

CONFIG = make_preset("tiny")
BUDGET = 8
PROMPTS = {0: (3, 1, 4, 1, 5), 1: (9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3)}
"""Request id -> token ids: the second prompt is longer than the budget (continued)."""


@pytest.mark.parametrize("warm_pass", [True, False])
def test_the_baseline_prefills_every_request_once_untimed_before_its_timed_pass(
    monkeypatch: pytest.MonkeyPatch, warm_pass: bool
) -> None:
    """With ``warm_pass`` every token of every request goes through the model once before
    the timed pass (arrivals ignored: the second request arrives after 0.2 s) and is not
    counted as finished; the timed pass then prefills them all again, and its final states
    equal the whole prompts'. Without it the timed pass is the first."""
    passes: list[list[int]] = []  # the tokens of each real forward, in order

    class Recording(MonolithicModel):
        def forward(self, prompts: Any, **kwargs: Any) -> Any:
            if all(isinstance(p, PromptChunk) for p in prompts):  # not a warm-up batch
                passes.append([t for p in prompts for t in p.tokens.tolist()])
            return super().forward(prompts, **kwargs)

    monkeypatch.setattr(monolithic, "MonolithicModel", Recording)
    monkeypatch.setattr(monolithic, "freeze_heap", lambda: None)  # not in the test process
    slot = SlotLayout(
        Topology(1, 1, CONFIG.n_routed_experts),
        CONFIG.hidden_size,
        BUDGET,
        CONFIG.num_experts_per_tok,
        dtype="float32",
    )
    connection = monolithic_connection(
        slot.window(ring_depth=1), Role.ATTENTION, 0, "", 1.0, device="cpu"
    )
    requests = [Request(i, len(t), 0.2 * i, tokens=t) for i, t in PROMPTS.items()]
    reader, writer = multiprocessing.Pipe(duplex=False)
    result = monolithic_replica(
        connection,
        config=CONFIG,
        seed=0,
        requests=requests,
        max_tokens=BUDGET,
        backend="reference",
        progress=writer,
        warm_pass=warm_pass,
    )["colocated"]
    every = sorted(t for tokens in PROMPTS.values() for t in tokens)
    timed = len(result.steps)  # the last forwards (the warm-up pass ignores arrivals)
    assert sorted(t for tokens in passes[-timed:] for t in tokens) == every
    untimed = sorted(t for tokens in passes[:-timed] for t in tokens)
    assert untimed == (every if warm_pass else [])
    if warm_pass:  # arrivals ignored: the second request shares the first step
        assert passes[0] == [*PROMPTS[0], *PROMPTS[1][:3]]
    counted = 0
    while reader.poll(0.1):
        reader.recv_bytes()
        counted += 1
    reader.close()
    writer.close()
    assert counted == len(PROMPTS)  # the warm-up pass finished nothing
    assert sorted(result.done) == sorted(PROMPTS)
    # The routing of the timed steps only, one record per step of its own token count.
    assert len(result.routing) == len(result.steps) == timed
    for routing, step in zip(result.routing, result.steps, strict=True):
        tokens = sum(end - begin for _, begin, end, _ in step)
        assert tuple(routing.shape) == (len(CONFIG.moe_layers), tokens, CONFIG.num_experts_per_tok)
    whole = MonolithicModel(CONFIG, RandomWeights(0))
    for request_id, tokens in PROMPTS.items():
        expected = whole.forward([torch.tensor(tokens)], compute_logits=False)
        torch.testing.assert_close(
            result.last_hidden[request_id],
            expected.last_hidden_states()[0].float(),
            rtol=1e-5,
            atol=1e-5,
        )
    connection.close()
