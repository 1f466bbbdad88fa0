"""Chunked prefill: a prompt longer than the batch budget prefilled over several calls, its
earlier chunks' compressed MLA keys kept in a KVCache, gives the unchunked result."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from afd_models import (
    AttentionRoleModel,
    ConfigError,
    FFNRoleExecutor,
    KVCache,
    MonolithicModel,
    PromptChunk,
    RandomWeights,
)
from afd_models import preset as make_preset
from afd_protocol import EndpointOptions, Role, SlotLayout, Topology
from afd_protocol.window import LoopbackWorld

BUDGET = 16


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(
        0, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def steps(prompts: dict[str, list[int]], budget: int) -> list[list[PromptChunk]]:
    """First come, first served steps of at most ``budget`` tokens, cutting prompts into
    chunks (what afd run's scheduler does)."""
    queue = [(key, tokens, 0) for key, tokens in prompts.items()]
    out = []
    while queue:
        step, used, rest = [], 0, []
        for key, tokens, done in queue:
            take = min(len(tokens) - done, budget - used)
            if take > 0:
                final = done + take == len(tokens)
                step.append(PromptChunk(key, tokens[done : done + take], done, final))
                used += take
                done += take
            if done < len(tokens):
                rest.append((key, tokens, done))
        out.append(step)
        queue = rest
    return out


def last_states(outputs: list[tuple[list[PromptChunk], torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The final chunk's last hidden state of every request."""
    found = {}
    for chunks, hidden in outputs:
        for chunk, state in zip(chunks, hidden, strict=True):
            if chunk.final:
                found[chunk.key] = state
    return found


@pytest.mark.parametrize("name", ["tiny", "v3-mini"])
def test_monolithic_chunks_of_1x_2_5x_and_8x_the_budget_equal_the_whole_prompts(name: str) -> None:
    config = make_preset(name)
    model = MonolithicModel(config, RandomWeights(3))
    prompts = {
        "one": prompt(BUDGET, 1, config.vocab_size),
        "short": prompt(3, 2, config.vocab_size),
        "two-and-a-half": prompt(BUDGET * 5 // 2, 3, config.vocab_size),
        "eight": prompt(BUDGET * 8, 4, config.vocab_size),
        "tiny": prompt(1, 5, config.vocab_size),
    }
    cache = KVCache()
    outputs = []
    plan = steps(prompts, BUDGET)
    assert any(not c.final for step in plan for c in step)  # something really is chunked
    for step in plan:
        out = model.forward(step, cache=cache, compute_logits=False)
        outputs.append((step, out.last_hidden_states()))
    assert len(cache) == 0  # every request finished: nothing kept
    got = last_states(outputs)
    for key, tokens in prompts.items():
        whole = model.forward([tokens], compute_logits=False).last_hidden_states()[0]
        torch.testing.assert_close(got[key], whole, rtol=1e-5, atol=1e-5)


def test_chunks_on_the_cpu_never_import_torch_dynamo() -> None:
    """A continued chunk on the CPU attends through a boolean mask built in place: the
    lower-right causal bias's module imports torch._dynamo (seconds, once per process, and
    inside whichever timed step first continued a prompt) and Triton, whose bindings print
    leak reports at exit. Checked in a fresh interpreter, where nothing else imported it."""
    code = (
        "import sys, torch\n"
        "from afd_models import KVCache, MonolithicModel, PromptChunk, RandomWeights, preset\n"
        "model = MonolithicModel(preset('tiny'), RandomWeights(3))\n"
        "cache = KVCache()\n"
        "model.forward([PromptChunk('a', [1, 2, 3], 0, final=False)], cache=cache)\n"
        "model.forward([PromptChunk('a', [4, 5], 3, final=True)], cache=cache)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'triton'))))\n"
    )
    assert _in_a_fresh_interpreter(code) == "[]"


def test_the_gpu_form_of_a_continued_chunks_mask_is_the_cpu_form() -> None:
    """The branch a GPU model takes (torch's lower-right causal bias, as built on CUDA)
    gives the CPU branch's output bitwise for continued chunks of several lengths and
    starts, run on the CPU where the bias is materialised: the two forms state one mask.
    In a fresh interpreter, as the bias's module imports torch._dynamo."""
    code = (
        "import torch\n"
        "from torch.nn.attention.bias import causal_lower_right\n"
        "from afd_models import KVCache, MonolithicModel, PromptChunk, RandomWeights, preset\n"
        "def run(model):\n"
        "    cache, out = KVCache(), []\n"
        "    for start, end in ((0, 5), (5, 6), (6, 19), (19, 23)):\n"
        "        step = [PromptChunk('a', list(range(1, 24))[start:end], start, end == 23)]\n"
        "        out.append(model.forward(step, cache=cache).last_hidden_states())\n"
        "    return torch.cat(out)\n"
        "cpu = MonolithicModel(preset('tiny'), RandomWeights(3))\n"
        "gpu_form = MonolithicModel(preset('tiny'), RandomWeights(3))\n"
        "for layer in gpu_form.trunk.layers:\n"
        "    layer.attention._lower_right = causal_lower_right\n"
        "a, b = run(cpu), run(gpu_form)\n"
        "assert torch.isfinite(a).all()\n"
        "print(torch.equal(a, b))\n"
    )
    assert _in_a_fresh_interpreter(code) == "True"


def _in_a_fresh_interpreter(code: str) -> str:
    """What ``code`` prints, run by a new Python (600 s at most: a loaded CI)."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_role_split_chunks_equal_the_monolithic_model() -> None:
    config = make_preset("tiny")
    topology = Topology(1, 2, config.n_routed_experts)
    layout = SlotLayout(
        topology, config.hidden_size, BUDGET, config.num_experts_per_tok, dtype="float32"
    )
    world = LoopbackWorld(layout.window(ring_depth=2))
    options = EndpointOptions(timeout=20.0, num_layers=config.num_hidden_layers, num_stages=2)
    failures: list[BaseException] = []

    def serve(rank: int) -> None:
        endpoint = world.connection(Role.FFN, rank).ffn_endpoint(options)
        executor = FFNRoleExecutor(config, endpoint.local_experts, RandomWeights(3))
        try:
            executor.serve(endpoint)
        except BaseException as exc:  # reported to the test thread
            failures.append(exc)

    threads = [threading.Thread(target=serve, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    endpoint = world.connection(Role.ATTENTION, 0).attention_endpoint(options)
    model = AttentionRoleModel(config, RandomWeights(3))
    prompts = {
        "long": prompt(BUDGET * 8, 7, config.vocab_size),
        "s": prompt(5, 8, config.vocab_size),
    }
    cache = KVCache()
    outputs = []
    try:
        for step in steps(prompts, BUDGET):
            out = model.forward(step, endpoint, num_stages=2, cache=cache, compute_logits=False)
            outputs.append((step, out.last_hidden_states()))
    finally:
        endpoint.announce_shutdown()
        for t in threads:
            t.join(timeout=30)
    assert not failures, failures
    reference = MonolithicModel(config, RandomWeights(3))
    got = last_states(outputs)
    for key, tokens in prompts.items():
        whole = reference.forward([tokens], compute_logits=False).last_hidden_states()[0]
        torch.testing.assert_close(got[key], whole, rtol=1e-5, atol=1e-5)


def test_chunks_out_of_order_or_without_a_cache_are_refused() -> None:
    config = make_preset("tiny")
    model = MonolithicModel(config, RandomWeights(0))
    with pytest.raises(ConfigError, match="pass a KVCache"):
        model.forward([PromptChunk("a", [1, 2], 0, final=False)])
    cache = KVCache()
    model.forward([PromptChunk("a", [1, 2], 0, final=False)], cache=cache)
    with pytest.raises(ConfigError, match="starting at position 5 but 2 of its tokens are cached"):
        model.forward([PromptChunk("a", [3], 5)], cache=cache)
    model.forward([PromptChunk("a", [3], 2)], cache=cache)  # the right start: accepted
    assert len(cache) == 0
