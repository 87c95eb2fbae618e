#!/usr/bin/env bash
# Kimi-K3 on one node of 8x AMD Instinct MI355X (gfx950, ROCm build of vLLM 0.32 to 0.34),
# with the vllm-k3-plugin parsers. Install once into the vLLM environment:
#     pip install /path/to/vllm-k3-plugin   # a checkout, or a wheel built from it
# The plugin loads itself in every vLLM process; the flags are vLLM's own.
set -euo pipefail

MODEL=${MODEL:-moonshotai/Kimi-K3}
PORT=${PORT:-8000}

# ROCm: use AITER kernels where vLLM has them.
export VLLM_ROCM_USE_AITER=${VLLM_ROCM_USE_AITER:-1}
# The plugin's replay policy for replies written inside the think channel:
# replay (default: reasoning streams live, the reply is sent again as content) or
# hold-back (think text is held until the channel is decided; nothing sent twice).
export VLLM_K3_REPLAY_POLICY=${VLLM_K3_REPLAY_POLICY:-replay}

exec vllm serve "$MODEL" \
    --tensor-parallel-size 8 \
    --kv-cache-dtype fp8 \
    --max-model-len "${MAX_MODEL_LEN:-262144}" \
    --reasoning-parser kimi_k3 \
    --enable-auto-tool-choice --tool-call-parser kimi_k3 \
    --port "$PORT" \
    "$@"
