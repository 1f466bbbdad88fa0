"""What the real-vLLM tests share: the loopback environment, the reference run (Hugging
Face transformers in float32, no vLLM, no afd) as a subprocess, and a small OpenAI-API
client (their checkpoints come from :func:`afd_vllm.tiny_model.write_tiny_model`). Runs
inside the vLLM venv only (``make vllm-engine``).

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
KV_CACHE_BYTES = 64 << 20
"""Each replica's KV cache (``--kv-cache-memory-bytes``): 9,696 tokens of these checkpoints'
MLA cache, 18 prompts of ``MAX_MODEL_LEN`` where a test has at most 3 in flight per
replica. ``VLLM_CPU_KVCACHE_SPACE`` counts whole GiB: with 1 GiB per replica the module took
328 s of CPU (mean of 3) against 317 s, and each worker 1.9 GB of RSS against 0.9 GB (two
cores, 2026-12-02). The size enters neither the compiled graph nor the outputs."""


def loopback_env(scratch: Path) -> dict[str, str]:
    """Everything on loopback, vLLM's caches inside the test's scratch directory, and only
    afd's plugin loaded."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    env.update(
        VLLM_HOST_IP="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo",
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
    """Greedy tokens and their logprobs from Hugging Face transformers in float32 (no vLLM,
    no afd): the reference the afd deployment must reproduce. On both checkpoints a plain,
    compiled vLLM engine gave the same tokens with logprobs within 2.1e-6 of it (measured
    2026-12-02), at a compiled engine start-up per model on two cores (about a minute
    each); eager vLLM is wrong for DeepSeek on the CPU platform (its rotary kernel
    mis-rotates the 3-D query), so it cannot stand in."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    result = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            tokens: list[int] = []
            logprobs: list[float] = []
            for _ in range(MAX_TOKENS):  # greedy, the whole sequence each step (tiny model)
                logits = lm(input_ids=ids).logits[0, -1]
                scores = torch.log_softmax(logits, dim=-1)
                token = int(scores.argmax())
                tokens.append(token)
                logprobs.append(float(scores[token]))
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            result.append({"token_ids": tokens, "logprobs": logprobs})
    Path(out).write_text(json.dumps(result))


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
