"""What the real-vLLM tests share: the loopback environment, the reference run (plain
vLLM, no afd) as a subprocess, and a small OpenAI-API client (their checkpoints come from
:func:`afd_vllm.tiny_model.write_tiny_model`). Runs inside the vLLM venv only
(``make vllm-engine``).

    python vllm_engine_support.py reference MODEL_DIR PROMPTS_JSON OUT_JSON [MODEL_DIR ...]
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MAX_TOKENS = 8
MAX_MODEL_LEN = 512
BATCHED_TOKENS = 2048
"""The engines' effective ``max_num_batched_tokens`` (given explicitly; the FFN's must match)."""


def loopback_env(scratch: Path) -> dict[str, str]:
    """Everything on loopback, vLLM's caches inside the test's scratch directory, and only
    afd's plugin loaded."""
    env = dict(os.environ)
    env.update(
        VLLM_HOST_IP="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_PLUGINS="afd",
        VLLM_CACHE_ROOT=str(scratch / "vllm-cache"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def prompt_text(seed: int, length: int) -> str:
    """A deterministic prompt of ``length`` word tokens (ids 3..511)."""
    return " ".join(f"t{3 + (seed * 131 + 17 * i) % 509}" for i in range(length))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def reference(model: str, prompts: list[str], out: str) -> None:
    """Greedy tokens and their logprobs from plain vLLM (fp32, compiled, no afd): what the
    afd deployment must reproduce. Compiled, as the afd side runs: vLLM's CPU platform
    mis-rotates DeepSeek's 3-D query in eager mode (which afd-vllm refuses for that
    reason)."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BATCHED_TOKENS,
        attention_backend="CPU_MLA",
        seed=0,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    result = []
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        logprobs = completion.logprobs or []
        result.append(
            {
                "token_ids": list(completion.token_ids),
                "logprobs": [
                    lp[t].logprob for t, lp in zip(completion.token_ids, logprobs, strict=True)
                ],
            }
        )
    Path(out).write_text(json.dumps(result))
    # The next model's engine starts in this process: end this one's engine core first.
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm
    gc.collect()


def complete(port: int, prompt: str, replica: int | None, timeout: float = 120.0) -> dict[str, Any]:
    """One greedy completion from the OpenAI API (token ids and logprobs), optionally pinned
    to a data-parallel replica with vLLM's ``X-data-parallel-rank`` header."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    headers = {"Content-Type": "application/json"}
    if replica is not None:
        headers["X-data-parallel-rank"] = str(replica)
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers=headers,
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        choice = json.loads(response.read())["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    return {
        "token_ids": [int(t.split(":", 1)[1]) for t in tokens],
        "logprobs": choice["logprobs"]["token_logprobs"],
    }


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


if __name__ == "__main__":
    if sys.argv[1] == "reference" and len(sys.argv) >= 5 and (len(sys.argv) - 2) % 3 == 0:
        for i in range(2, len(sys.argv), 3):  # one vLLM import for every model
            model, prompts, out = sys.argv[i : i + 3]
            reference(model, json.loads(Path(prompts).read_text()), out)
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
