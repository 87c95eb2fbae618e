#!/usr/bin/env bash
# Kimi-K3 on one node of 8 NVIDIA GPUs (H200/B200 class, CUDA build of vLLM 0.32 to 0.34),
# with the vllm-k3-plugin parsers. Install once into the vLLM environment:
#     pip install /path/to/vllm-k3-plugin   # a checkout, or a wheel built from it
set -euo pipefail

MODEL=${MODEL:-moonshotai/Kimi-K3}
PORT=${PORT:-8000}
export VLLM_K3_REPLAY_POLICY=${VLLM_K3_REPLAY_POLICY:-replay}

exec vllm serve "$MODEL" \
    --tensor-parallel-size 8 \
    --kv-cache-dtype fp8 \
    --max-model-len "${MAX_MODEL_LEN:-262144}" \
    --reasoning-parser kimi_k3 \
    --enable-auto-tool-choice --tool-call-parser kimi_k3 \
    --port "$PORT" \
    "$@"
